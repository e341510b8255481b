"""Prompt processing on the batch-invariant path against the path it replaced, side by side in one run.

Batch-invariant (the default): a prompt step runs on the native step, as decode steps do, so a position's numbers
are the same whatever step computed it (docs/failover.md). Replaced: a prompt step ran the Python layers, whose
products take oneDNN's float32 GEMM (over 16-bit matrices widened, or quantized ones dequantized, a chunk at a
time), which picks its blocking, and so its sums' order, by the number of rows. Both on one engine holding the
whole file, as a node loads it (bench_vs_llamacpp.py's ExoSide); the path is switched between runs on that engine.

Files (bench_vs_llamacpp.py's, built once and cached): smollm2-f32, smollm2-bf16 (16-bit matrices), qwen-q4_k_m
(llama-quantize's Q4_K_M of a Qwen2.5-0.5B-shaped checkpoint; needs ../shared/tools/llamacpp.sh or LLAMACPP_SH).
For each file and prompt length: each path timed on one step of P tokens from an empty cache, warmed up just before,
paths alternating, median of --repeats; ratio = invariant / replaced (above 1: the invariant path is faster).

Usage: python bench/bench_invariant_prompt.py [--threads 2] [--prompts 64,512] [--repeats 3]
           [--files smollm2-f32,smollm2-bf16,qwen-q4_k_m]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_llamacpp as bench  # noqa: E402  (sets the OpenMP spin limit before torch loads)
import torch  # noqa: E402

PATHS = {"invariant": True, "replaced": False}  # NativeDecode.prompts


def rates(side: bench.ExoSide, prompts: list[int], repeats: int) -> dict[tuple[str, int], float]:
    runs: dict[tuple[str, int], list[float]] = {}
    native = side.engine.model.native_decode
    if native is None:
        raise SystemExit(f"{side.path.name}: the native step does not run this file (no compiler, or its family)")
    for _ in range(repeats):
        for name, on in PATHS.items():
            native.prompts = on
            for p in prompts:
                side.on_engine(side._prompt, p)  # warm-up, as llama-bench warms up each test
                runs.setdefault((name, p), []).append(side.on_engine(side._prompt, p))
    native.prompts = True
    return {key: statistics.median(values) for key, values in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", default="64,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--files", default="smollm2-f32,smollm2-bf16,qwen-q4_k_m")
    opts = parser.parse_args()
    prompts = [int(p) for p in opts.prompts.split(",")]
    torch.set_num_threads(opts.threads)
    side_opts = argparse.Namespace(threads=opts.threads, prompts=prompts, gen=8, depth=0, repeats=1, extra_dtypes=[])
    print(f"prompt processing, tokens/s, {opts.threads} threads, median of {opts.repeats} alternating runs")
    print(f"{'file':<16} {'form':<34} {'test':<7} {'invariant':>10} {'replaced':>10} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as work:
        for name, path in bench.bench_files(opts.files.split(","), Path(work)):
            side = bench.ExoSide(path, None, side_opts)
            try:
                measured = rates(side, prompts, opts.repeats)
                for p in prompts:
                    new, old = measured[("invariant", p)], measured[("replaced", p)]
                    print(f"{name:<16} {side.form:<34} {f'pp{p}':<7} {new:>10.1f} {old:>10.1f} {new / old:>6.2f}",
                          flush=True)
            finally:
                side.close()


if __name__ == "__main__":
    main()
