"""The OpenMP spin limit a node sets before torch loads (exo_like/engines/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from exo_like.engines.openmp import WORKER_SPIN_COUNT, limit_worker_spin


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
