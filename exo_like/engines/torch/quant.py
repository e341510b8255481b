"""Quantized matrices on the PyTorch engine, held quantized (no dequantized copy).

On CPU they run on the engine's native kernels (native/: codes at their own width, int8 activation blocks, as
llama.cpp runs them) where those could be built; otherwise, and as described below, on PyTorch's int4 kernel.

PyTorch's CPU kernel `_weight_int4pack_mm_for_cpu` multiplies bfloat16 activations by 4-bit codes with a
bfloat16 scale and zero per group of inputs: w = (q - 8) * scale + zero. An AffineGroups matrix (w = s*q + b)
maps onto it exactly:
- up to 4 bits: one pack, scale s, zero b + 8 s;
- 5 to 8 bits: two packs of the high and low nibbles, q = 16 h + l: the high one with scale 16 s, the low one
  with scale s; their zeros share out the bias (see int4_packs) and their products add up to the whole.
Shapes the kernel refuses (footprint.int4_refusal), other devices and types without an affine form (GGUF's
Q2_K, Q3_K, Q6_K) are dequantized by the engine instead: on CPU to bfloat16 `Dense` pieces (half float32's bytes,
and oneDNN's bfloat16 matmul is no slower there than float32's), elsewhere to the engine's dtype.

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
import logging
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from exo_like.engines.base import WeightForms
from exo_like.models.affine import AffineGroups
from exo_like.engines.torch.native.build import kernels
from exo_like.engines.torch.native.matrix import HalfMatrix, NativeMatrix
from exo_like.engines.torch.native.matrix import refusal as native_refusal
from exo_like.models.footprint import int4_refusal

log = logging.getLogger(__name__)

KERNEL_DTYPE = torch.bfloat16  # the only activation dtype the CPU kernel runs fast (others take a slow path)
PACK_ROWS = 4096  # rows packed per call, a multiple of the kernel's 64-row blocks: bounds the int32 copy it takes


def native_kernels(device: torch.device) -> ModuleType | None:
    """The native quantized kernels where they run (CPU) and could be built (else None: torch's int4 kernel)."""
    return kernels() if device.type == "cpu" else None


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


def cpu_numerics() -> dict[str, str]:
    """What the CPU changes in how this engine computes, for the log and GET /v1/cluster: the capability ATen's
    kernels are built for (their vector width sets float32 reductions' order), the int4 pack layout, and whether
    the CPU multiplies bfloat16 natively (oneDNN then runs bfloat16 products on it; without it they are
    widened to float32)."""
    layout = pack_layout() if hasattr(torch, "_convert_weight_to_int4pack_for_cpu") else None
    native = kernels()
    return {"quantized_kernel": "torch int4 (no native kernels)" if native is None else
            f"native ({native.kernel_name()})",
            "aten_capability": torch.backends.cpu.get_cpu_capability(),
            "int4_pack_layout": "unknown (a copy of the codes for lookups)" if layout is None else
            f"{layout.name} ({layout.block}-row blocks)",
            "bfloat16": _bfloat16_support()}


def _bfloat16_support() -> str:
    capabilities = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    native = [name for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if capabilities.get(flag)]
    return f"native ({', '.join(native)})" if native else "widened to float32 (no AVX512-BF16 or AMX)"


Piece = list[Int4Pack] | NativeMatrix | HalfMatrix | torch.Tensor
NATIVE_PIECES = (NativeMatrix, HalfMatrix)  # the native kernels' matrices: float32 activations in and out


class QuantLinear(nn.Module):
    """x @ w.T (+ bias) with w held quantized or 16-bit: a native matrix (float32 activations), or int4 packs
    (activations cast to bfloat16 for the kernel, the result back to the input's dtype). `pieces` stack along the
    outputs, so a fused projection may mix quantized and (dequantized) dense matrices, as GGUF files mixing
    types per tensor need."""

    def __init__(self, pieces: list[Piece], bias: torch.Tensor | None):
        super().__init__()
        self.pieces = pieces
        self.bias = bias
        self.native = len(pieces) == 1 and isinstance(pieces[0], NATIVE_PIECES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:  # the common case, without the per-piece dispatch below
            out = self.pieces[0].matmul(x.float()).to(x.dtype)
            return out if self.bias is None else out + self.bias
        x16 = x.to(KERNEL_DTYPE) if any(isinstance(p, list) or p.dtype == KERNEL_DTYPE for p in self.pieces
                                        if not isinstance(p, NATIVE_PIECES)) else None
        outputs = [self._piece(x, x16, piece) for piece in self.pieces]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out if self.bias is None else out + self.bias

    @staticmethod
    def _piece(x: torch.Tensor, x16: torch.Tensor | None, piece: Piece) -> torch.Tensor:
        if isinstance(piece, NATIVE_PIECES):
            return piece.matmul(x.float()).to(x.dtype)
        if isinstance(piece, torch.Tensor):
            return F.linear(x16 if piece.dtype == KERNEL_DTYPE else x.to(piece.dtype), piece).to(x.dtype)
        out = piece[0].matmul(x16).to(x.dtype)
        for pack in piece[1:]:
            out += pack.matmul(x16).to(x.dtype)
        return out

    def tensors(self) -> list[torch.Tensor]:
        """Everything this layer holds (for counting its memory)."""
        held = [] if self.bias is None else [self.bias]
        for piece in self.pieces:
            held += [piece] if isinstance(piece, torch.Tensor) else piece.tensors() \
                if isinstance(piece, NATIVE_PIECES) else [t for pack in piece for t in pack.tensors()]
        return held


class QuantEmbedding(nn.Module):
    """Rows of an int4-packed embedding, dequantized on lookup (to float32, then the model's dtype). The codes
    are read from the packs in `layout`, or from `copies` (one per pack) when their layout is unknown."""

    def __init__(self, packs: list[Int4Pack], dtype: torch.dtype, layout: PackLayout | None,
                 copies: list[NibbleCodes] | None = None):
        super().__init__()
        if (layout is None) == (copies is None):
            raise ValueError("an embedding reads its codes from its packs (a layout) or from copies, not both")
        self.packs, self.dtype, self.layout, self.copies = packs, dtype, layout, copies

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = None
        for i, pack in enumerate(self.packs):
            codes = pack.codes(ids, self.layout) if self.copies is None else self.copies[i].codes(ids)
            part = pack.dequantized_rows(codes, ids)
            rows = part if rows is None else rows + part
        return rows.to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for pack in self.packs for t in pack.tensors()] + [c.packed for c in self.copies or []]


class NativeEmbedding(nn.Module):
    """Rows of a natively packed (or 16-bit) embedding, dequantized on lookup (to float32, then the model's
    dtype)."""

    def __init__(self, matrix: NativeMatrix | HalfMatrix, dtype: torch.dtype):
        super().__init__()
        self.matrix, self.dtype = matrix, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.rows(ids).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.matrix.tensors()


class CastEmbedding(nn.Module):
    """An embedding held in another dtype than the model's (a dequantized fallback): rows cast on lookup."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.weight_rows, self.dtype = weight, dtype  # not `weight`: that name would make it a parameter

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_rows).to(self.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight_rows]


@dataclass
class Dense:
    """A quantized matrix that no kernel here takes, dequantized (in Installer.dense_dtype), or a 16-bit
    checkpoint's matrix kept in its dtype beside float32 activations (engine.half_storage). With the native
    kernels either runs as a HalfMatrix."""

    weight: torch.Tensor


Matrix = AffineGroups | Dense | torch.Tensor


def stack_rows(parts: list[Matrix | list[Matrix]]) -> Matrix | list[Matrix]:
    """Matrices stacked along their outputs (q, k, v fused into one projection): one tensor or one AffineGroups
    when they share a form, else the list of pieces for a QuantLinear."""
    flat = [p for part in parts for p in (part if isinstance(part, list) else [part])]
    if all(isinstance(p, torch.Tensor) for p in flat):
        return torch.cat(flat)
    if all(isinstance(p, Dense) for p in flat):
        return Dense(torch.cat([p.weight for p in flat]))
    if all(isinstance(p, AffineGroups) and p.same_form(flat[0]) for p in flat):
        return AffineGroups.stack(flat)
    return flat


class Installer:
    """Puts quantized modules into a ShardModel built on the meta device, from its state dict's quantized
    entries (AffineGroups, or lists of pieces), and counts what ran on the kernel and what was dequantized."""

    def __init__(self, dtype: torch.dtype, device: torch.device, use_kernel: bool, native: ModuleType | None = None):
        """use_kernel: torch's int4 kernel runs on this device; native: the native kernels (CPU), which then
        take every matrix they can."""
        self.dtype, self.device, self.use_kernel, self.native = dtype, device, use_kernel, native
        # On CPU the activations are float32, but a dequantized matrix is held in bfloat16 (half the bytes).
        self.dense_dtype = KERNEL_DTYPE if use_kernel else dtype
        self.forms = WeightForms()
        self._pieces: dict[int, Piece] = {}  # by id(AffineGroups)

    def dense(self, values: np.ndarray, why: str) -> Dense:
        """A dequantized matrix (`why`: its type and the reason it has no kernel, for the counts)."""
        self.forms.add_dequantized(why)
        return Dense(torch.from_numpy(values).to(device=self.device, dtype=self.dense_dtype))

    def install(self, model: nn.Module, state: dict[str, Matrix | list[Matrix]]) -> None:
        for name in [n for n, v in state.items() if not isinstance(v, torch.Tensor)]:
            value, path = state.pop(name), name.removesuffix(".weight")
            pieces = [self._piece(p) for p in (value if isinstance(value, list) else [value])]
            module = model.get_submodule(path)
            if all(isinstance(p, torch.Tensor) and p.dtype == self.dtype for p in pieces):
                state[name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
                continue
            if isinstance(module, nn.Embedding):
                replacement: nn.Module = CastEmbedding(pieces[0], self.dtype) if isinstance(pieces[0], torch.Tensor) \
                    else NativeEmbedding(pieces[0], self.dtype) if isinstance(pieces[0], NATIVE_PIECES) \
                    else self._embedding(value, pieces[0])
            else:
                replacement = QuantLinear(pieces, state.pop(f"{path}.bias", None))
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, replacement)

    def _piece(self, matrix: Matrix) -> Piece:
        if isinstance(matrix, torch.Tensor):
            return matrix
        if isinstance(matrix, Dense):
            weight = matrix.weight
            if self.native is not None and weight.dtype in (torch.bfloat16, torch.float16):
                return HalfMatrix(weight.contiguous(), self.native)
            return weight
        if id(matrix) not in self._pieces:  # a tied embedding and head are one AffineGroups: one piece
            self._pieces[id(matrix)] = self._convert(matrix)
        return self._pieces[id(matrix)]

    def _convert(self, matrix: AffineGroups) -> Piece:
        if self.native is not None and native_refusal(matrix) is None:
            self.forms.add_quantized(matrix.source)
            return NativeMatrix.pack(matrix, self.native)
        refusal = "no int4 kernel on this device" if not self.use_kernel else \
            int4_refusal(matrix.bits, matrix.group_size, matrix.shape[0])
        if refusal is not None:
            return self.dense(matrix.dequantize(), f"{matrix.source} ({refusal})").weight
        self.forms.add_quantized(matrix.source)
        return int4_packs(matrix)

    def _embedding(self, matrix: AffineGroups, packs: list[Int4Pack]) -> QuantEmbedding:
        codes = code_planes(matrix)
        layout = pack_layout()
        if layout is not None and all(check_layout(pack, c, layout) for pack, c in zip(packs, codes)):
            return QuantEmbedding(packs, self.dtype, layout)
        copies = [NibbleCodes(c) for c in codes]
        log.warning("held beyond the weights: a copy of the embedding's codes for lookups, %.1f MB (this torch "
                    "build packs int4 weights in a layout not read here)", sum(c.packed.nbytes for c in copies) / 1e6)
        return QuantEmbedding(packs, self.dtype, None, copies)
