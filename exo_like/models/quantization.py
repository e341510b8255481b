"""Quantized MLX checkpoints (the mlx-community layout): what a config's `quantization` entry means.

Such a checkpoint stores each quantized matrix as three tensors: `X.weight` (uint32, `bits`-bit integers packed
least-significant bits first), `X.scales` and `X.biases` (one per `group_size` consecutive inputs), with
w = scales * q + biases per group (`mx.dequantize`, mode "affine"). Only the uniform form is supported: one
{group_size, bits} for the whole model. Per-layer settings (mixed-precision conversions) and other quantization
schemes (GPTQ, AWQ, bitsandbytes, MLX's fp4/fp8 modes) are rejected with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exo_like.errors import UnsupportedModelError

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)
# Keys a uniform mlx-lm `quantization` entry may carry besides group_size and bits.
_UNIFORM_KEYS = {"group_size", "bits", "mode"}
QUANTIZED_SUFFIXES = (".scales", ".biases")


@dataclass(frozen=True)
class QuantSpec:
    group_size: int
    bits: int

    def to_json(self) -> dict[str, int]:
        return {"group_size": self.group_size, "bits": self.bits}


def quant_spec(quantization: dict[str, Any] | None) -> QuantSpec | None:
    """The uniform spec of a config's `quantization` entry; None for a float checkpoint.

    Raises UnsupportedModelError (code unsupported_quantization) for any other shape, naming what was found."""
    if not quantization:
        return None
    if "quant_method" in quantization:
        raise _unsupported(f"{quantization['quant_method']!r} quantization is not supported; only MLX affine "
                           f"checkpoints (mlx-community, config `quantization: {{group_size, bits}}`) are")
    extra = set(quantization) - _UNIFORM_KEYS
    if extra:
        # mlx-lm writes per-layer overrides as extra keys named after module paths.
        raise _unsupported(f"per-layer quantization settings are not supported (found entries for "
                           f"{', '.join(sorted(extra)[:3])}{', ...' if len(extra) > 3 else ''}); only a uniform "
                           f"{{group_size, bits}} checkpoint is")
    mode = quantization.get("mode", "affine")
    if mode != "affine":
        raise _unsupported(f"MLX quantization mode {mode!r} is not supported; only 'affine' is")
    group_size, bits = quantization.get("group_size"), quantization.get("bits")
    if group_size not in GROUP_SIZES or bits not in BITS:
        raise _unsupported(f"quantization group_size={group_size!r}, bits={bits!r} is not supported; group_size "
                           f"must be one of {GROUP_SIZES} and bits one of {BITS}")
    return QuantSpec(int(group_size), int(bits))


def _unsupported(message: str) -> UnsupportedModelError:
    return UnsupportedModelError(message, code="unsupported_quantization")
