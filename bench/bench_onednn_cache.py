"""What oneDNN's caches of compiled products cost a torch CPU node in memory, with the libraries' default size
(1,024 entries each) and with the engine's cap (torch_model.ONEDNN_CACHE_ENTRIES).

A serving node's steps have many row counts (prefill chunks of every length, replays after a re-plan); each new
row count compiles a product for each weight shape. This runs the float32 packed-weight products of the
SmolLM2-135M shape at every row count from 1 to --rows, in a fresh process per setting (the libraries read their
cache size on the first product), and prints the resident growth and the time taken every 128 row counts.

Usage: python bench/bench_onednn_cache.py [--rows 512]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo_like.engines.torch.model import ONEDNN_CACHE_ENTRIES  # noqa: E402

PRODUCTS = """
import sys, time
import psutil, torch
torch.set_num_threads(2)
shapes = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # q/o, k/v, gate/up, down
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i), 16) for o, i in shapes]
process = psutil.Process()
base, started = process.memory_info().rss, time.monotonic()
for rows in range(1, int(sys.argv[1]) + 1):
    for weight, (_, inputs) in zip(weights, shapes):
        torch.ops.mkldnn._linear_pointwise(torch.randn(rows, inputs), weight, None, "none", [], "")
    if rows % 128 == 0:
        grown = (process.memory_info().rss - base) / 2**20
        print(f"  {rows:>5} row counts: +{grown:7.1f} MB resident, {time.monotonic() - started:5.1f} s", flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    rows = parser.parse_args().rows
    for label, entries in (("library default", None), ("engine's cap", ONEDNN_CACHE_ENTRIES)):
        env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                                  "LRU_CACHE_CAPACITY")}
        if entries is not None:
            env |= {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(entries), "LRU_CACHE_CAPACITY": str(entries)}
        print(f"{label} ({entries or 1024} entries per cache):", flush=True)
        subprocess.run([sys.executable, "-c", PRODUCTS, str(rows)], env=env, check=True)


if __name__ == "__main__":
    main()
