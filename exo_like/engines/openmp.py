"""How long PyTorch's OpenMP worker threads spin after a parallel region: set before torch is imported.

After each parallel region libgomp's workers spin 300,000 iterations before they sleep (about 8 ms measured on
this project's 2-core EPYC), so that the next region starts without a wake-up. Inside one forward pass the next
region follows within well under a millisecond and that is what the spin is for. After a stage's last region,
though, the stage hands its activations on and waits for the rest of the ring, and its workers keep spinning
on cores that the next stage needs when stages share a machine (or anything else runs there). Three stages
on one host decoded at 0.66 of one node's speed because of it. A tenth of the default (~0.8 ms here) still
bridges the gaps inside a forward pass (one node's decode speed is unchanged within noise), gives the cores
back soon after, and lifts that ratio to 0.91 (`bench/bench_cluster.py`, `--spincount 300000` for the default).

libgomp reads the setting once, when it is loaded, so this must run before the first `import torch`. An explicit
GOMP_SPINCOUNT or OMP_WAIT_POLICY from the user wins.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

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
