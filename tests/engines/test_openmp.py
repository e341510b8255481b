"""The OpenMP settings of a torch node (exo_like/engines/torch/openmp.py): spin limit, and one core per thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from exo_like.engines.torch.openmp import (
    PLACEMENT_VARIABLES,
    WORKER_SPIN_COUNT,
    _parse_cpu_list,
    cores_for_team,
    limit_worker_spin,
)


def test_spin_is_limited_when_the_user_chose_nothing() -> None:
    env: dict[str, str] = {}
    assert limit_worker_spin(env) == WORKER_SPIN_COUNT
    assert env == {"GOMP_SPINCOUNT": WORKER_SPIN_COUNT}
    assert int(WORKER_SPIN_COUNT) < 300000  # shorter than libgomp's own default, or it would change nothing


def test_an_explicit_spin_count_or_wait_policy_wins() -> None:
    env = {"GOMP_SPINCOUNT": "infinite"}
    assert limit_worker_spin(env) == "infinite" and env == {"GOMP_SPINCOUNT": "infinite"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert limit_worker_spin(env) is None and env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_cli_sets_it_before_anything_imports_torch(tmp_path) -> None:
    # `exo-like --help` exits inside parse_args; a bad --port does too. Instead run main() far enough to set the
    # limit and check, in the same process, that torch was not loaded yet and the variable is set.
    script = (
        "import os, sys\n"
        "import exo_like.cli as cli\n"
        "assert 'torch' not in sys.modules, 'importing the CLI must not load torch'\n"
        "cli.Node = None  # stop main() right after the spin limit, before it builds a node\n"
        "try:\n"
        "    cli.main(['--home', sys.argv[1], '--no-mdns'])\n"
        "except TypeError:\n"
        "    pass\n"
        "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [WORKER_SPIN_COUNT, "False"]


def test_a_team_gets_one_core_per_thread_and_only_when_it_covers_every_core() -> None:
    hyperthreaded = {0: 0, 1: 0, 2: 1, 3: 1}  # cpus 2 and 3 are the second hardware threads of cores 0 and 1
    assert cores_for_team([3, 2, 1, 0], 2, hyperthreaded) == [0, 1]
    assert cores_for_team([0, 1, 2, 3], 4, hyperthreaded) == [0, 1, 2, 3]
    assert cores_for_team([0, 1, 2, 3], 4, {}) == [0, 1, 2, 3]
    assert cores_for_team([0, 1, 2, 3], 2, {}) is None  # would leave two cores idle that the node may use
    assert cores_for_team([0, 1], 3, {}) is None  # more threads than cpus
    assert cores_for_team([5], 1, {}) is None  # one thread: nothing to keep apart
    assert _parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]


PIN_SCRIPT = """
import json, os, sys, threading
import torch
from exo_like.engines.torch.openmp import pin_openmp_team

def affinity(tid):
    return sorted(os.sched_getaffinity(tid))

def engine_thread(result):
    torch.set_num_threads(2)
    result["pinned"] = pin_openmp_team(2)
    a = torch.randn(1500, 1500)
    for _ in range(40):
        a @ a
    threads = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        threads[tid] = (affinity(tid), int(fields[11]) + int(fields[12]))
    result["threads"] = threads
    result["engine"] = threading.get_native_id()

result = {}
worker = threading.Thread(target=engine_thread, args=(result,))
worker.start()
worker.join()
result["main"] = affinity(0)
print(json.dumps(result))
"""


def _run_pin_script(env_changes: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PLACEMENT_VARIABLES}
    env.update({"OMP_NUM_THREADS": "2", **env_changes})
    out = subprocess.run([sys.executable, "-c", PIN_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) != 2,
                    reason="needs Linux with exactly 2 usable cpus (as on this project's machine and CI)")
def test_the_engine_threads_team_is_pinned_and_does_the_work() -> None:
    result = _run_pin_script({})
    assert result["pinned"] == sorted(os.sched_getaffinity(0))
    threads = {int(tid): (cpus, ticks) for tid, (cpus, ticks) in result["threads"].items()}
    engine_cpus, engine_ticks = threads.pop(result["engine"])
    assert engine_cpus == result["pinned"][:1]  # the calling thread is thread 0 of its team
    [(worker_cpus, worker_ticks)] = [v for v in threads.values() if v[0] == result["pinned"][1:]]
    assert worker_ticks > 0 and engine_ticks > 0  # torch's matmuls ran on the pinned pair
    assert result["main"] == sorted(os.sched_getaffinity(0))  # other threads are left alone


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux thread affinity")
def test_the_users_placement_setting_wins() -> None:
    result = _run_pin_script({"OMP_PROC_BIND": "false"})
    assert result["pinned"] is None
    assert all(cpus == sorted(os.sched_getaffinity(0)) for cpus, _ in result["threads"].values())


TEAM_SCRIPT = """
import json, os
import torch
from exo_like.engines.torch.engine import TorchEngine
torch.set_num_threads(2)
def threads():
    return len(os.listdir("/proc/self/task"))
before = threads()
engine = TorchEngine(device="cpu")
after_engine = threads()
torch.ones(1 << 22).sum()  # a parallel region on this thread
print(json.dumps({"before": before, "after_engine": after_engine, "after_region": threads()}))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
def test_creating_the_engine_starts_no_openmp_team_on_the_creating_thread() -> None:
    # A node creates its engine on the main thread and computes on the engine thread. A parallel region run on
    # the main thread would leave a second OpenMP team alive: more threads than cores, and libgomp then sleeps
    # and wakes the engine's workers at every region (the node's decode step went from 15 to 25 ms). The CPU
    # probes the engine reports (which pack weights in parallel) wait for its first load, on its own thread.
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", TEAM_SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout)
    assert counts["after_engine"] == counts["before"], counts
    assert counts["after_region"] > counts["before"], counts  # what the count would show had the engine run one
