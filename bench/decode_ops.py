"""Where a decode step's time goes on a CPU node, for one GGUF file (the bench's files, or any): the step (median of
3 runs of 32 tokens, as bench_vs_llamacpp.py's tg), each projection kind timed alone on one row and summed over
the layers (a mixture's experts: top k calls of one expert's), the LM head, and the rest (norms, rotary, attention,
routing, Python) = step - their sum.

Usage: python bench/decode_ops.py FILE.gguf [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_vs_llamacpp as bench  # noqa: E402  (sets the OpenMP spin limit before torch loads)
import torch  # noqa: E402

from exo_like.engines.torch.native.matrix import HalfMatrix  # noqa: E402
from exo_like.engines.torch.quant import native_kernels  # noqa: E402


def timed_ms(run: Callable[[], Any]) -> float:
    run()
    times = []
    for _ in range(9):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def projection_ms(side: bench.ExoSide, module: Any) -> float:
    """One row through the projection as the step runs it: a plain float or 16-bit weight on the native row kernel
    where the shard runs the native step (module.forward would take oneDNN's path instead), else its forward."""
    width = module.pieces[0].shape[1] if hasattr(module, "pieces") else module.weight.shape[1]
    x = torch.randn(1, width)
    kernels = native_kernels(x.device)
    plain = getattr(module, "weight", None)
    pieces = getattr(module, "pieces", [])
    if len(pieces) == 1 and isinstance(pieces[0], HalfMatrix):  # a 16-bit checkpoint's matrix: the step reads it so
        plain = pieces[0].weight
    if side.engine.model.native_decode is not None and kernels is not None and isinstance(plain, torch.Tensor) \
            and not getattr(module, "packed", False):
        weight = plain.detach().contiguous()
        return side.on_engine(timed_ms, lambda: kernels.rows_matmul(x, weight))
    return side.on_engine(timed_ms, lambda: module.forward(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    side = bench.ExoSide(opts.file, None, argparse.Namespace(threads=opts.threads, prompts=[64], gen=32, depth=0,
                                                             repeats=1, extra_dtypes=[]))
    model = side.engine.model
    step_ms = 1000 / statistics.median(side.on_engine(side._gen, 32) for _ in range(3))
    parts: dict[str, float] = {}
    for layer in model.layers:
        kinds = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj}
        if hasattr(layer.mlp, "experts"):
            expert = layer.mlp.experts[0]
            kinds["router"] = layer.mlp.gate
            for name, module in (("experts gate_up", expert.gate_up_proj), ("experts down", expert.down_proj)):
                parts[name] = parts.get(name, 0.0) + layer.mlp.top_k * projection_ms(side, module)
        else:
            kinds.update({"gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj})
        for name, module in kinds.items():
            parts[name] = parts.get(name, 0.0) + projection_ms(side, module)
    parts["LM head"] = projection_ms(side, model.lm_head)
    print(f"{opts.file.name}: {1000 / step_ms:.1f} tok/s, step {step_ms:.2f} ms "
          f"(native step: {model.native_decode is not None})")
    for name, ms in parts.items():
        print(f"  {name:16s} {ms:7.2f} ms")
    print(f"  {'rest':16s} {step_ms - sum(parts.values()):7.2f} ms")
    side.close()


if __name__ == "__main__":
    main()
