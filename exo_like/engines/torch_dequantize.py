"""Dequantize an MLX-quantized checkpoint's matrices for the PyTorch engine (which runs them in float).

Same arithmetic as `mx.dequantize` (mode "affine"): the uint32 words hold `bits`-bit integers as one
little-endian bit stream, least-significant bits first (so for 4 bits, value j of a word is bits 4j..4j+3),
and each run of `group_size` consecutive inputs has w = scales * q + biases, computed in float32.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from exo_like.quantization import QuantSpec


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 (or int32) [..., n] -> the packed integers as uint8 [..., n * 32 / bits]."""
    stream = packed.contiguous().view(torch.uint8)  # little-endian bytes, in stream order on every torch host
    if 8 % bits == 0:
        # 2, 4 and 8 bits never straddle a byte: shift each byte's values down, lowest first.
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        values = (stream[..., None] >> shifts) & ((1 << bits) - 1)
        return values.flatten(-2)
    # 3, 5 and 6 bits cross byte boundaries: expand to single bits and reassemble each value.
    single = (stream[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    single = single.flatten(-2).unflatten(-1, (-1, bits))
    weights = (1 << torch.arange(bits, dtype=torch.uint8))
    return (single * weights).sum(-1, dtype=torch.uint8)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """[out, in * bits / 32] packed + [out, in / group_size] scales and biases -> float32 [out, in]."""
    q = unpack(packed, spec.bits).to(torch.float32)
    groups = q.unflatten(-1, (-1, spec.group_size))
    if groups.shape[-2] != scales.shape[-1]:
        raise ValueError(f"packed weight {list(packed.shape)} does not match scales {list(scales.shape)} for "
                         f"{spec.bits}-bit groups of {spec.group_size}")
    w = scales.to(torch.float32)[..., None] * groups + biases.to(torch.float32)[..., None]
    return w.flatten(-2)


def dequantize_tensors(raw: dict[str, torch.Tensor], spec: QuantSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for a shard's checkpoint tensors with every quantized `X.weight` + `X.scales` +
    `X.biases` triple replaced by the float `X.weight`; other tensors pass through. Consumes `raw`."""
    for name in [n for n in raw if n.endswith(".scales")]:
        prefix = name.removesuffix(".scales")
        packed, scales = raw.pop(f"{prefix}.weight"), raw.pop(name)
        biases = raw.pop(f"{prefix}.biases")
        yield f"{prefix}.weight", dequantize(packed, scales, biases, spec)
    for name in list(raw):
        yield name, raw.pop(name)
