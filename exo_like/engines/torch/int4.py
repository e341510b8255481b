"""PyTorch's CPU int4 kernel for quantized matrices where the native kernels (native/) could not be built.

`_weight_int4pack_mm_for_cpu` multiplies bfloat16 activations by 4-bit codes with a bfloat16 scale and zero per
group of inputs: w = (q - 8) * scale + zero. An AffineGroups matrix (w = s*q + b) maps onto it exactly:
- up to 4 bits: one pack, scale s, zero b + 8 s;
- 5 to 8 bits: two packs of the high and low nibbles, q = 16 h + l: the high one with scale 16 s, the low one
  with scale s; their zeros share out the bias (see int4_packs) and their products add up to the whole.

The kernel keeps its packs in a private layout, which differs between torch's CPU builds (PackLayout). An
embedding needs rows of the matrix, not products: its rows are decoded from the packs themselves, in the layout
this build writes (found once by packing a probe, `pack_layout`, then checked on the embedding's own codes at
load, `check_layout`). Only a build writing none of the known layouts makes the embedding keep a second copy of
its codes, two to a byte (`NibbleCodes`), which costs memory and is logged.

Numerics (the same on every CPU capability: the kernel's source has one algorithm per ISA, all alike): each
output is a float32 sum, input by input in order, of bf16(x) * ((q - 8) * bf16(scale) + bf16(zero)), rounded
once to bfloat16. So against float32 activations the path differs by the bfloat16 rounding of the activations,
of each pack's outputs, and of the scales and zeros; tests/models/test_gguf.py compares it with a reference that rounds
at the same points.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from exo_like.models.affine import AffineGroups

KERNEL_DTYPE = torch.bfloat16  # the only activation dtype the CPU kernel runs fast (others take a slow path)
PACK_ROWS = 4096  # rows packed per call, a multiple of the kernel's 64-row blocks: bounds the int32 copy it takes


def int4_kernel_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(torch, "_weight_int4pack_mm_for_cpu")


@dataclass(frozen=True)
class PackLayout:
    """Where torch's `_convert_weight_to_int4pack_for_cpu` puts code (row, input) (its weight_to_int4pack_kernel):
    rows in blocks of `block`, each block [in, rows / 2] bytes. In a full block of a vectorized build (`halves`),
    byte j holds rows j (low nibble) and j + block / 2 (high nibble); in a shorter last block, and in every
    block of the scalar build, byte j holds rows 2j and 2j + 1."""

    name: str  # the CPU capability that packs this way
    block: int
    halves: bool


# ATen's packing per capability (aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel).
PACK_LAYOUTS = (PackLayout("AVX-512", 64, True), PackLayout("AVX2", 32, True), PackLayout("scalar", 32, False))
# A probe's rows: full blocks of 64 then one of 16 (for 32-row blocks: full blocks then one of 16), and full
# blocks of 64 then one of 48 (of 32: full blocks then 16), so every kind of block of each layout is read back.
_PROBE_ROWS, _PROBE_INPUTS = (144, 112), 32


@functools.cache
def pack_layout() -> PackLayout | None:
    """The layout this torch build packs in, found by packing probes of random codes and reading them back with
    each known layout (None: none reads them back, so Int4Pack.codes cannot be used)."""
    rng = np.random.default_rng(0)
    probes = [rng.integers(0, 16, (rows, _PROBE_INPUTS), dtype=np.uint8) for rows in _PROBE_ROWS]
    packs = [torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(p.astype(np.int32)), 1) for p in probes]
    for layout in PACK_LAYOUTS:
        if all(torch.equal(codes_in_layout(pack, torch.arange(len(p)), layout), torch.from_numpy(p))
               for pack, p in zip(packs, probes)):
            return layout
    return None


def codes_in_layout(packed: torch.Tensor, ids: torch.Tensor, layout: PackLayout) -> torch.Tensor:
    """The 4-bit codes of rows `ids` [n] of a pack [out, in / 2] written in `layout` -> uint8 [n, in]."""
    out, half = packed.shape
    flat = packed.reshape(-1)
    block, within = ids // layout.block, ids % layout.block
    block_rows = torch.clamp(out - block * layout.block, max=layout.block)
    by_halves = (block_rows == layout.block) & layout.halves
    column = torch.where(by_halves, within % (layout.block // 2), within // 2)
    high = torch.where(by_halves, within // (layout.block // 2), within % 2)
    stride = block_rows // 2  # bytes per input in the row's block
    base = block * layout.block * half + column
    index = base[:, None] + torch.arange(2 * half)[None, :] * stride[:, None]
    return (flat[index] >> (4 * high)[:, None].to(torch.uint8)) & 0x0F


@dataclass
class Int4Pack:
    """One int4 matrix in the kernel's layout: packed codes [out, in/2] and scale/zero [in/group, out, 2]."""

    packed: torch.Tensor
    scale_zeros: torch.Tensor
    group_size: int

    @classmethod
    def from_codes(cls, codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group_size: int) -> "Int4Pack":
        rows = [torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(chunk.astype(np.int32)), 1)
                for chunk in np.split(codes, range(PACK_ROWS, codes.shape[0], PACK_ROWS))]
        scale_zeros = torch.from_numpy(np.stack([scales.T, zeros.T], axis=-1)).to(KERNEL_DTYPE).contiguous()
        return cls(torch.cat(rows), scale_zeros, group_size)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed, self.scale_zeros

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] bfloat16 -> [rows, out] bfloat16."""
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zeros)

    def codes(self, ids: torch.Tensor, layout: PackLayout) -> torch.Tensor:
        """The 4-bit codes of rows `ids` [n] -> uint8 [n, in], read from the pack (see check_layout)."""
        return codes_in_layout(self.packed, ids, layout)

    def dequantized_rows(self, codes: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """float32 [n, in] of rows `ids` given their codes."""
        scale_zeros = self.scale_zeros[:, ids].float()  # [in/group, n, 2]
        scale = scale_zeros[..., 0].T.repeat_interleave(self.group_size, dim=1)
        zero = scale_zeros[..., 1].T.repeat_interleave(self.group_size, dim=1)
        return (codes.float() - 8) * scale + zero


def check_layout(pack: Int4Pack, codes: np.ndarray, layout: PackLayout) -> bool:
    """Whether Int4Pack.codes reads back exactly `codes` from this pack in `layout` (the kernel's is private)."""
    ids = torch.arange(codes.shape[0])
    for start in range(0, len(ids), PACK_ROWS):
        chunk = ids[start:start + PACK_ROWS]
        if not torch.equal(pack.codes(chunk, layout), torch.from_numpy(codes[start:start + PACK_ROWS])):
            return False
    return True


class NibbleCodes:
    """4-bit codes [out, in] held two to a byte, row by row: the embedding's copy of its codes when the packs'
    layout is none this module reads (half the bytes of one code per byte)."""

    def __init__(self, codes: np.ndarray):
        self.packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))

    def codes(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed[ids]
        return torch.stack([rows & 0x0F, rows >> 4], dim=-1).reshape(len(ids), -1)


def code_planes(groups: AffineGroups) -> list[np.ndarray]:
    """The 4-bit codes of each pack int4_packs makes: the codes themselves up to 4 bits, else the high
    nibbles (centred on the kernel's 8, which keeps its partial sums small: the two products are added after
    each is rounded to bfloat16) and the low nibbles."""
    if groups.bits <= 4:
        return [groups.codes]
    return [(groups.codes >> 4) + np.uint8(8 - _high_centre(groups.bits)), groups.codes & 0x0F]


def _high_centre(bits: int) -> int:
    """Half the number of values a high nibble takes (2**(bits-4) of them)."""
    return 2 ** (bits - 4) // 2


def int4_packs(groups: AffineGroups) -> list[Int4Pack]:
    """The packs whose products add up to x @ w.T (one for up to 4 bits, two for 5 to 8)."""
    s, b = groups.scales, groups.biases
    planes = code_planes(groups)
    if len(planes) == 1:
        return [Int4Pack.from_codes(planes[0], s, b + 8 * s, groups.group_size)]
    high_zero, low_zero = _place_bias(16 * _high_centre(groups.bits) * s, 8 * s, b)
    return [Int4Pack.from_codes(planes[0], 16 * s, high_zero, groups.group_size),
            Int4Pack.from_codes(planes[1], s, low_zero, groups.group_size)]


def _place_bias(high: np.ndarray, low: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Add each group's bias to the zero it shrinks most: a symmetric type's bias (-128 s for Q8_0) cancels
    the high zero exactly, and small zeros keep the products' rounding small."""
    on_high = np.abs(high + bias) + np.abs(low) <= np.abs(high) + np.abs(low + bias)
    return np.where(on_high, high + bias, high), np.where(on_high, low, low + bias)
