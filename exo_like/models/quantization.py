"""Quantized MLX checkpoints (the mlx-community layout): what a config's `quantization` entry means.

Such a checkpoint stores each quantized matrix as three tensors: `X.weight` (uint32, `bits`-bit integers packed
least-significant bits first), `X.scales` and `X.biases` (one per `group_size` consecutive inputs), with
w = scales * q + biases per group (`mx.dequantize`, mode "affine"). One {group_size, bits} holds for the model, and
mlx-lm's mixed-precision conversions name the modules that differ (`"model.layers.0.mlp.gate": {group_size: 64,
bits: 8}`: a mixture's routers kept at 8 bits).

MXFP4 (mode "mxfp4": groups of 32 FP4 values, a power-of-two scale each stored as a byte, no biases) is gpt-oss's
form: MLX-format checkpoints say `mode: mxfp4`; the Hub's own gpt-oss checkpoints say `quant_method: mxfp4` and
store the experts as `*_blocks` / `*_scales` (the gpt-oss family turns them into the MLX form when reading). Other
schemes (GPTQ, AWQ, bitsandbytes, MLX's other float modes) are rejected with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exo_like.errors import UnsupportedModelError

GROUP_SIZES = (32, 64, 128)
BITS = (2, 3, 4, 5, 6, 8)
MXFP4 = "mxfp4"
# Keys a uniform mlx-lm `quantization` entry may carry besides group_size and bits.
_UNIFORM_KEYS = {"group_size", "bits", "mode"}
QUANTIZED_SUFFIXES = (".scales", ".biases")


@dataclass(frozen=True)
class QuantSpec:
    group_size: int
    bits: int
    # (checkpoint module path, spec) of the modules quantized otherwise than the model
    overrides: tuple[tuple[str, "QuantSpec"], ...] = ()
    mode: str = "affine"  # or MXFP4

    def to_json(self) -> dict[str, int | str]:
        return {"group_size": self.group_size, "bits": self.bits, **({"mode": self.mode} if self.mxfp4 else {})}

    @property
    def mxfp4(self) -> bool:
        return self.mode == MXFP4

    def for_module(self, path: str) -> "QuantSpec":
        """The spec of the module at checkpoint path `path` (e.g. `model.layers.3.mlp.gate`)."""
        for module, spec in self.overrides:
            if module == path:
                return spec
        return QuantSpec(self.group_size, self.bits, mode=self.mode)

    def mlx_settings(self) -> dict[str, int | str]:
        """What mlx.nn.quantize takes for a module of this spec."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def quant_spec(quantization: dict[str, Any] | None) -> QuantSpec | None:
    """The uniform spec of a config's `quantization` entry; None for a float checkpoint.

    Raises UnsupportedModelError (code unsupported_quantization) for any other shape, naming what was found."""
    if not quantization:
        return None
    if quantization.get("quant_method") == MXFP4:  # the Hub's gpt-oss: experts as blocks and scales
        return QuantSpec(32, 4, mode=MXFP4)
    if "quant_method" in quantization:
        raise _unsupported(f"{quantization['quant_method']!r} quantization is not supported; only MLX affine "
                           f"checkpoints (mlx-community, config `quantization: {{group_size, bits}}`) and MXFP4 are")
    uniform = _checked(quantization, "quantization")
    overrides = []
    for key in sorted(set(quantization) - _UNIFORM_KEYS):
        value = quantization[key]
        # mlx-lm writes per-module settings under the module's path; `false` marks one left in float, which its
        # missing `.scales` says as well.
        if value is False:
            continue
        if not isinstance(value, dict) or "." not in key:
            raise _unsupported(f"unknown quantization setting {key!r}: {value!r}")
        overrides.append((key, _checked(value, key)))
    return QuantSpec(uniform.group_size, uniform.bits, tuple(overrides), uniform.mode)


def _checked(settings: dict[str, Any], where: str) -> QuantSpec:
    mode = settings.get("mode", "affine")
    group_size, bits = settings.get("group_size"), settings.get("bits")
    if mode == MXFP4:
        if (group_size, bits) != (32, 4):
            raise _unsupported(f"mxfp4 quantization takes groups of 32 4-bit values, got group_size={group_size!r}, "
                               f"bits={bits!r} ({where})")
        return QuantSpec(32, 4, mode=MXFP4)
    if mode != "affine":
        raise _unsupported(f"MLX quantization mode {mode!r} ({where}) is not supported; only 'affine' and "
                           f"'{MXFP4}' are")
    if group_size not in GROUP_SIZES or bits not in BITS:
        raise _unsupported(f"quantization group_size={group_size!r}, bits={bits!r} ({where}) is not supported; "
                           f"group_size must be one of {GROUP_SIZES} and bits one of {BITS}")
    return QuantSpec(int(group_size), int(bits))


def _unsupported(message: str) -> UnsupportedModelError:
    return UnsupportedModelError(message, code="unsupported_quantization")
