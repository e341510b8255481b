"""PyTorch's OpenMP threads on a CPU node: how long they spin after a parallel region, and where they run.

First, the spin (set before torch is imported). After each parallel region libgomp's workers spin 300,000
iterations before they sleep (about 8 ms measured on this project's 2-core EPYC), so that the next region starts
without a wake-up. Inside one forward pass the next region follows within well under a millisecond and that is
what the spin is for. After a stage's last region, though, the stage hands its activations on and waits for the
rest of the ring, and its workers keep spinning on cores that the next stage needs when stages share a machine
(or anything else runs there). Three stages on one host decoded at 0.66 of one node's speed because of it. A
tenth of the default (~0.8 ms here) still bridges the gaps inside a forward pass (one node's decode speed is
unchanged within noise), gives the cores back soon after, and lifts that ratio to 0.91
(`bench/bench_cluster.py`, `--spincount 300000` for the default).

libgomp reads the setting once, when it is loaded, so this must run before the first `import torch`. An explicit
GOMP_SPINCOUNT or OMP_WAIT_POLICY from the user wins.

Second, where those threads run. A stage's workers sleep while the rest of the ring computes, and the kernel
often wakes one onto the core its master thread already occupies; seen with `perf sched`, master and worker
then took turns on one core for up to 30 ms while the other core stood idle, and a tenth of all ring steps
were 25-100 % slower. When the team covers every core the node may use, `pin_openmp_team` binds thread i of
the engine thread's team to its own core (measured: one node 3 % faster, three nodes on one host 9 %, and
the bench's ratio from about 0.91 to 0.93-0.97, median 0.942 over nine runs).
Setting OMP_PROC_BIND, OMP_PLACES or GOMP_CPU_AFFINITY (e.g. OMP_PROC_BIND=false) leaves placement to libgomp.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

WORKER_SPIN_COUNT = "30000"  # iterations; libgomp's default is 300000


def limit_worker_spin(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GOMP_SPINCOUNT unless the user chose a spin or wait policy. Returns the spin count now in effect
    for a libgomp loaded after this call (None: the user's OMP_WAIT_POLICY decides)."""
    if "GOMP_SPINCOUNT" in environ:
        return environ["GOMP_SPINCOUNT"]
    if "OMP_WAIT_POLICY" in environ:
        return None
    if "torch" in sys.modules:
        log.warning("torch was imported before the OpenMP spin limit was set: idle stages will spin longer")
    environ["GOMP_SPINCOUNT"] = WORKER_SPIN_COUNT
    return WORKER_SPIN_COUNT


PLACEMENT_VARIABLES = ("OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY")


def cores_for_team(allowed: Iterable[int], num_threads: int, sibling_rank: Mapping[int, int]) -> list[int] | None:
    """The CPU for each thread of a team, one physical core each first; None if pinning would idle a core the
    node may use (fewer threads than cores) or crowd one (more threads than CPUs).

    sibling_rank: a CPU's position among the hyperthreads of its core (0 for the first); missing means 0."""
    ordered = sorted(allowed, key=lambda cpu: (sibling_rank.get(cpu, 0), cpu))
    cores = sum(1 for cpu in ordered if sibling_rank.get(cpu, 0) == 0)
    if num_threads < 2 or not cores <= num_threads <= len(ordered):
        return None
    return ordered[:num_threads]


def _sibling_ranks(cpus: Iterable[int]) -> dict[int, int]:
    ranks = {}
    for cpu in cpus:
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        except OSError:
            continue
        siblings_in_order = _parse_cpu_list(siblings)
        ranks[cpu] = siblings_in_order.index(cpu) if cpu in siblings_in_order else 0
    return ranks


def _parse_cpu_list(text: str) -> list[int]:
    """'0-1,4' -> [0, 1, 4] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            first, _, last = part.partition("-")
            cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _loaded_libgomp() -> ctypes.CDLL | None:
    """The libgomp this process already uses (torch's bundled copy has its own file name), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1]
        if path.startswith("/") and Path(path).name.startswith("libgomp"):
            return ctypes.CDLL(path)  # the same file again: dlopen hands back the loaded copy
    return None


def pin_openmp_team(num_threads: int, environ: Mapping[str, str] = os.environ) -> list[int] | None:
    """Bind the calling thread's OpenMP team (the one torch's CPU kernels will use from this thread) one thread
    per core. Returns the CPU of each team thread, or None when it left placement alone.

    Call it on the engine thread: the calling thread becomes the team's thread 0 and is bound too."""
    if any(name in environ for name in PLACEMENT_VARIABLES) or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = os.sched_getaffinity(0)
    cpus = cores_for_team(allowed, num_threads, _sibling_ranks(allowed))
    libgomp = _loaded_libgomp() if cpus else None
    if cpus is None or libgomp is None:
        return None
    libgomp.omp_get_thread_num.restype = ctypes.c_int
    placed: dict[int, int] = {}

    def bind_this_thread(_data: int | None) -> None:  # runs once in every thread of the team
        index = libgomp.omp_get_thread_num()
        try:
            os.sched_setaffinity(0, {cpus[index]})
            placed[index] = cpus[index]
        except (OSError, IndexError) as exc:  # an exception must not cross back into libgomp
            log.warning("could not bind OpenMP thread %d: %s", index, exc)

    body = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(bind_this_thread)
    # GOMP_parallel is what compiled `#pragma omp parallel num_threads(n)` calls: it runs `body` on the same
    # pooled team torch's own parallel regions from this thread reuse.
    libgomp.GOMP_parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    libgomp.GOMP_parallel(ctypes.cast(body, ctypes.c_void_p), None, num_threads, 0)
    if len(placed) != num_threads:
        return None
    return [placed[index] for index in range(num_threads)]
