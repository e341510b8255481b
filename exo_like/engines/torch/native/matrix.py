"""A quantized matrix packed for the native kernels (quant.cpp): its codes at their own width, scales and biases as
the checkpoint stores them.

From AffineGroups (w = scale * q + bias per group), without re-rounding anything:
- codes of up to 4 bits: two a byte (NIBBLES); 5 or 6 bits (Q5_0/1, MXFP4 as exact 5-bit codes): the low nibbles
  plus the top two bits four a byte (HIGH2); 7 or 8 bits (Q8_0, MLX 8-bit): a byte each (BYTES);
- scales and biases in the 16-bit type that holds them exactly (float16 for GGUF's legacy types, bfloat16 for
  MLX's and MXFP4's powers of two), or for K-quants as they store them (a code a group times a float32 a
  super-block, GroupFactors); a symmetric type (Q4_0, Q5_0, Q8_0, MXFP4, Q6_K: bias = -zero * scale) keeps
  no biases. Which matrices the kernels take, and their bytes, follow the type (footprint.native_form), so a plan
  counts what a node will hold.
Where the kernels run AVX-512 code (vnni.cpp), every tensor of the matrix is stored with its rows interleaved in
blocks of 16 (`interleave`): the same bytes, another order.
The kernel's arithmetic, and `reference_matmul` that states it in numpy, are described in quant.cpp.

A HalfMatrix is a 16-bit float matrix for the same engine path (half.cpp): float32 activations, each weight widened.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from exo_like.models.affine import AffineGroups
from exo_like.models.footprint import native_form, native_refusal, stacked_form

_EMPTY = torch.empty(0, dtype=torch.float32)
_EMPTY_CODES = torch.empty(0, dtype=torch.uint8)
BLOCK = 32  # inputs per activation block (and per block of packed codes)
CODE_MAX = 32767  # the activations' int16 codes
NIBBLES, HIGH2, BYTES = 0, 1, 2


def form_of(groups: AffineGroups) -> str:
    """The matrix's native form by its type (a stack's: every part's), as footprint.native_form names it."""
    form = stacked_form([native_form(part, groups.bits) for part in groups.source.split("+")])
    if form.startswith("k"):
        # A tensor-parallel rank's slice across super-blocks loses the stored form: float32 scales then (ranks'
        # shares are planned approximately anyway), so every rank runs the same kernels as a whole node.
        return form if groups.factors is not None else "float32"
    return form if groups.sixteen_bit_scales else ""


def refusal(groups: AffineGroups) -> str | None:
    """Why the native kernels cannot hold this matrix (None if they can). Its type says whether its scales are
    16-bit numbers; an MLX checkpoint's are its own dtype, which may be float32 (the footprint reads the same)."""
    form = form_of(groups)
    why = native_refusal(groups.bits, groups.group_size, groups.shape[1], form)
    if why is None and form.startswith("half") and _sixteen_bit(groups.scales, groups.biases) is None:
        return "scales not 16-bit numbers"
    return why


def _sixteen_bit(*values: np.ndarray) -> torch.dtype | None:
    """The 16-bit type holding every value exactly (float16 first), or None."""
    return next((dtype for dtype in (torch.float16, torch.bfloat16)
                 if all(_exactly(v, dtype) is not None for v in values)), None)


def layout_of(bits: int) -> int:
    return NIBBLES if bits <= 4 else HIGH2 if bits <= 6 else BYTES


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """[out, in] codes < 16 -> [out, in / 2] bytes: per block of 32, byte j = q[j] | q[j + 16] << 4."""
    out, inputs = codes.shape
    halves = codes.reshape(out, inputs // BLOCK, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(out, inputs // 2)


def _top_bits(codes: np.ndarray) -> np.ndarray:
    """[out, in] codes < 64 -> their top two bits [out, in / 4]: per block, byte j = h[j] | h[j+8] << 2 | ..."""
    out, inputs = codes.shape
    quarters = (codes >> 4).reshape(out, inputs // BLOCK, 4, 8)
    return (quarters[:, :, 0] | (quarters[:, :, 1] << 2) | (quarters[:, :, 2] << 4) | (quarters[:, :, 3] << 6)) \
        .reshape(out, inputs // 4)


def interleave(t: torch.Tensor, unit: int, rows: int) -> torch.Tensor:
    """t [out, n] with each block of `rows` rows' units (`unit` elements each) side by side: unit j of row r at
    (r - i) * n / unit + j * width + i, i = r % rows, `width` the rows of r's block (quant.h's Matrix.unit).
    The same shape; rows=1 leaves t as it is."""
    if rows == 1 or t.numel() == 0:
        return t
    out, n = t.shape
    units = t.reshape(out, n // unit, unit)
    full = out - out % rows
    parts = [units[:full].reshape(full // rows, rows, n // unit, unit).transpose(1, 2).reshape(-1)]
    if full < out:
        parts.append(units[full:].transpose(0, 1).reshape(-1))
    return torch.cat(parts).reshape(out, n)


def _exactly(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor | None:
    """values as `dtype`, if every one survives the conversion unchanged."""
    converted = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
    return converted if torch.equal(converted.float(), torch.from_numpy(np.asarray(values, np.float32))) else None


def _symmetric_zero(groups: AffineGroups) -> float | None:
    """zero when every bias is exactly -zero * scale (zero an integer), else None."""
    nonzero = np.flatnonzero(groups.scales)
    if not nonzero.size:
        return None
    zero = float(np.rint(-groups.biases.flat[nonzero[0]] / groups.scales.flat[nonzero[0]]))
    return zero if np.array_equal(groups.biases, np.float32(-zero) * groups.scales) else None


@dataclass
class NativeMatrix:
    """One packed matrix [out, in] and the kernels that run it."""

    low: torch.Tensor  # NIBBLES/HIGH2: uint8 [out, in / 2]; BYTES: [out, in]
    high: torch.Tensor  # HIGH2: uint8 [out, in / 4]; empty otherwise
    scales: torch.Tensor  # [out, groups] float16 or bfloat16 (float32 where packed for a test), or K-quants' codes
    biases: torch.Tensor  # like scales, or empty: bias = -zero * scale
    super_scales: torch.Tensor  # K-quants: float32 [out, super-blocks] (scale = code * super); else empty
    super_biases: torch.Tensor
    zero: float
    bits: int
    group_size: int
    kernels: ModuleType

    @classmethod
    def pack(cls, groups: AffineGroups, kernels: ModuleType, scale_dtype: torch.dtype | None = None) -> "NativeMatrix":
        """scale_dtype: hold scales and biases so (None: the 16-bit type holding them exactly; see refusal)."""
        codes, layout = groups.codes, layout_of(groups.bits)
        low = torch.from_numpy(np.ascontiguousarray(codes if layout == BYTES else _nibbles(codes & 0x0F)))
        high = torch.from_numpy(_top_bits(codes) if layout == HIGH2 else np.empty(0, dtype=np.uint8))
        if form_of(groups).startswith("k"):
            return cls._with_factors(groups, low, high, kernels)
        zero = _symmetric_zero(groups) if form_of(groups) == "half-symmetric" else None
        kept = [groups.scales] if zero is not None else [groups.scales, groups.biases]
        dtype = scale_dtype or (torch.float32 if form_of(groups) == "float32" else _sixteen_bit(*kept))
        held = [_exactly(v, dtype) if dtype is not None else None for v in kept]
        if any(h is None for h in held):
            raise ValueError(f"{groups.source}: scales not exact in {dtype or 'a 16-bit type'}")
        biases = held[1] if zero is None else torch.empty(0, dtype=held[0].dtype)
        return cls._stored(low, high, held[0], biases, _EMPTY, _EMPTY, 0.0 if zero is None else zero, groups.bits,
                           groups.group_size, kernels)

    @classmethod
    def _with_factors(cls, groups: AffineGroups, low: torch.Tensor, high: torch.Tensor,
                      kernels: ModuleType) -> "NativeMatrix":
        """K-quants: their scales (and biases) as stored, a code a group and a float32 a super-block."""
        f = groups.factors
        symmetric = f.bias_codes is None
        return cls._stored(low, high, torch.from_numpy(np.ascontiguousarray(f.scale_codes)),
                           _EMPTY_CODES if symmetric else torch.from_numpy(np.ascontiguousarray(f.bias_codes)),
                           torch.from_numpy(np.ascontiguousarray(f.super_scales, dtype=np.float32)),
                           _EMPTY if symmetric else
                           torch.from_numpy(np.ascontiguousarray(f.super_biases, dtype=np.float32)),
                           float(f.zero) if symmetric else 0.0, groups.bits, groups.group_size, kernels)

    @classmethod
    def _stored(cls, low: torch.Tensor, high: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                super_scales: torch.Tensor, super_biases: torch.Tensor, zero: float, bits: int, group_size: int,
                kernels: ModuleType) -> "NativeMatrix":
        """The matrix as this process's kernels read it: codes in 4-byte units, factors one by one, interleaved
        by the kernels' row block (1: row-major)."""
        rows = kernels.row_block()
        codes = [interleave(t, 4, rows) for t in (low, high)]
        factors = [interleave(t, 1, rows) for t in (scales, biases, super_scales, super_biases)]
        return cls(*codes, *factors, zero, bits, group_size, kernels)

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group_size

    def kernel_args(self) -> tuple:
        """What the kernels take after the activations: (low, high, scales, biases, super scales, super biases,
        layout, zero, group)."""
        return self.low, self.high, self.scales, self.biases, self.super_scales, self.super_biases, \
            layout_of(self.bits), self.zero, self.group_size

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 -> x @ w.T [rows, out] float32."""
        return self.kernels.matmul(x, *self.kernel_args())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized: float32 [n, in], as AffineGroups.dequantize gives them."""
        return self.kernels.rows(ids, *self.kernel_args())

    def tensors(self) -> list[torch.Tensor]:
        return [self.low, self.high, self.scales, self.biases, self.super_scales, self.super_biases]


@dataclass
class HalfMatrix:
    """A matrix [out, in] held as 16-bit floats (a bfloat16 or float16 checkpoint's, or a quantized type no kernel
    takes, dequantized) and multiplied by float32 activations on the native kernels (half.cpp): each weight widened
    exactly, float32 sums, no rounding of the activations."""

    weight: torch.Tensor  # bfloat16 or float16, contiguous
    kernels: ModuleType

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 -> x @ w.T [rows, out] float32."""
        return self.kernels.half_matmul(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 [n, in] (exact)."""
        return self.weight.index_select(0, ids).float()

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight]


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's activations: per block of 32, scale d = max|x| / 32767 and q = round-half-even(x / d)
    computed as x * (1 / d) in float32. Returns (q int16 [rows, in], d float32 [rows, in / 32])."""
    rows, inputs = x.shape
    blocks = x.astype(np.float32).reshape(rows, inputs // BLOCK, BLOCK)
    d = (np.abs(blocks).max(axis=-1) / np.float32(CODE_MAX)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inverse = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.rint((blocks * inverse[..., None]).astype(np.float32)).astype(np.int16)
    return q.reshape(rows, inputs), d


def reference_matmul(x: np.ndarray, groups: AffineGroups) -> np.ndarray:
    """What the kernel computes, in float64 from the same int16 activations: sum over half blocks of
    scale * d * (exact integer dot) + sum over groups of bias * (float sum of the group's inputs)."""
    q, d = quantize_activations(x)
    rows, inputs = x.shape
    out, _ = groups.shape
    size = groups.group_size
    products = np.einsum("rk,nk->rnk", q.astype(np.float64), groups.codes.astype(np.float64))  # exact
    per_16 = products.reshape(rows, out, inputs // 16, 16).sum(-1)  # exact integers
    block_d = np.repeat(d.astype(np.float64), 2, axis=1)  # the block scale of each half block
    scale_16 = np.repeat(groups.scales.astype(np.float64), size // 16, axis=1)  # each half block's scale
    integral = (per_16 * block_d[:, None, :] * scale_16[None]).sum(-1)
    group_sums = x.astype(np.float32).reshape(rows, inputs // size, size).sum(-1, dtype=np.float64)
    return integral + group_sums @ groups.biases.astype(np.float64).T
