"""A node's first request after a restart, with the native CPU kernels (loaded from their cache) and without them
(EXO_LIKE_NATIVE=0, the engine before they existed): the time from starting `exo-like` to its cluster being ready,
and the first request's latency. Alternating runs, medians, ratios native / without.

The node serves `make run`'s model (SmolLM2-135M-Instruct Q4_1, a home of its own per run with the model already
in place, as a restarted node has it). The kernels' cache is built first if missing (that build happens once, at
install, not at a restart).

Usage: python bench/bench_restart.py [--runs 3] [--threads 2] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo_like.engines.torch.native.build import kernels  # noqa: E402
from tests.api_server import NodeProcess, start_node  # noqa: E402

PROMPT = "Write one sentence about lighthouses."


def first_request(home: Path, model: str, threads: int, native: bool) -> tuple[float, float]:
    """(seconds from launch to a ready cluster, seconds of the first request: 16 tokens)."""
    started = time.perf_counter()
    node = start_node(home, model, "--no-mdns", threads=threads, env={"EXO_LIKE_NATIVE": None if native else "0"})
    try:
        wait_ready(node)
        ready = time.perf_counter() - started
        asked = time.perf_counter()
        status, _, body = node.request("POST", "/v1/chat/completions", (
            '{"model": "%s", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": "%s"}]}'
            % (model, PROMPT)).encode(), {"Content-Type": "application/json"})
        assert status == 200, body
        return ready, time.perf_counter() - asked
    finally:
        node.stop()


def wait_ready(node: NodeProcess, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not node.get_json("/health")["cluster_ready"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout}s:\n{node.log()}")
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="smollm2-135m")
    opts = parser.parse_args()
    if kernels() is None:
        raise SystemExit("no native kernels here: nothing to compare")
    figures: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as root:
        for run in range(opts.runs + 1):  # run 0 puts the model in place in each home; not counted
            for native in (True, False):
                got = first_request(Path(root) / f"home-{native}", opts.model, opts.threads, native)
                if run:
                    figures[native].append(got)
                print(f"run {run} {'native' if native else 'without'}: ready after {got[0]:.2f} s, "
                      f"first request {got[1]:.3f} s{'' if run else ' (not counted)'}", flush=True)
    for index, what in ((0, "launch to ready"), (1, "first request")):
        native, without = (statistics.median(f[index] for f in figures[k]) for k in (True, False))
        print(f"{what}: native {native:.3f} s, without {without:.3f} s, ratio {native / without:.2f}")


if __name__ == "__main__":
    main()
