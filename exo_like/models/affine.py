"""Quantized matrices in one framework-free form: integer codes with a scale and a bias per group of inputs.

Every quantized format this project reads comes down to it: an MLX checkpoint's packed words with its
`scales` and `biases`, GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K blocks (see gguf/blocks.py), and MXFP4
(FP4 values with a power-of-two scale per 32: not affine in 4 bits, exactly so in 5, see from_mxfp4).
w[n, k] = scales[n, k // group_size] * codes[n, k] + biases[n, k // group_size], the arithmetic of
`mx.dequantize` (mode "affine"). Each engine turns this form into what its quantized kernels take (MLX's packed
words, torch's int4 packs), so no engine knows any file format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class GroupFactors:
    """Scales (and biases) as GGUF's K-quants store them: a small integer per group times a float per run of
    `per_super` groups (its super-block): scales = scale_codes * super_scales, biases = bias_codes * super_biases,
    or, without bias codes, biases = -zero * scales (Q6_K). The products are the AffineGroups' float32 values
    exactly (they are how its decoder computed them); kernels that read this form hold a byte a group, not a
    float."""

    scale_codes: np.ndarray  # uint8 or int8 [out, groups]
    super_scales: np.ndarray  # float32 [out, groups // per_super]
    bias_codes: np.ndarray | None  # uint8 [out, groups]
    super_biases: np.ndarray | None  # float32 [out, groups // per_super]
    zero: int  # without bias codes
    per_super: int

    def arrays(self) -> tuple[np.ndarray | None, ...]:
        return self.scale_codes, self.super_scales, self.bias_codes, self.super_biases

    def map(self, transform: Callable[[np.ndarray], np.ndarray], per_group: Callable[[np.ndarray], np.ndarray]
            | None = None, per_super: Callable[[np.ndarray], np.ndarray] | None = None) -> "GroupFactors":
        """The factors with `transform` applied to every array, or `per_group` / `per_super` to each kind."""
        groups, supers = per_group or transform, per_super or transform
        return GroupFactors(groups(self.scale_codes), supers(self.super_scales),
                            None if self.bias_codes is None else groups(self.bias_codes),
                            None if self.super_biases is None else supers(self.super_biases), self.zero,
                            self.per_super)

    def take_groups(self, first: int, last: int) -> "GroupFactors | None":
        """Groups [first, last), when they fall on whole super-blocks (else None: the plain scales remain)."""
        if first % self.per_super or last % self.per_super:
            return None
        return self.map(np.ascontiguousarray, lambda t: np.ascontiguousarray(t[:, first:last]),
                        lambda t: np.ascontiguousarray(t[:, first // self.per_super:last // self.per_super]))

    def same_form(self, other: "GroupFactors") -> bool:
        return (self.per_super, self.zero, self.scale_codes.dtype, self.bias_codes is None) == \
            (other.per_super, other.zero, other.scale_codes.dtype, other.bias_codes is None)

    @staticmethod
    def stack(parts: Sequence["GroupFactors | None"]) -> "GroupFactors | None":
        """Factors of matrices stacked along their outputs (None unless every part has them, in one form)."""
        first = parts[0]
        if first is None or not all(p is not None and first.same_form(p) for p in parts):
            return None
        joined = [np.concatenate([getattr(p, name) for p in parts]) if getattr(first, name) is not None else None
                  for name in ("scale_codes", "super_scales", "bias_codes", "super_biases")]
        return GroupFactors(*joined, first.zero, first.per_super)


@dataclass(frozen=True)
class AffineGroups:
    """A quantized [out, in] matrix: codes in [0, 2**bits), one scale and bias per `group_size` inputs."""

    codes: np.ndarray  # uint8 [out, in]
    scales: np.ndarray  # float32 [out, in // group_size]
    biases: np.ndarray  # float32 [out, in // group_size]
    bits: int
    group_size: int
    source: str  # what the file stored, for logs: "Q4_K", "mlx 4-bit"
    # Whether the file stores the scales (and biases) as 16-bit numbers (an MLX checkpoint stores its dtype's):
    # kernels that keep them so need to know, as planning does from the file's header.
    sixteen_bit_scales: bool = True
    factors: GroupFactors | None = None  # the scales' and biases' stored form (K-quants)

    def __post_init__(self) -> None:
        out, inputs = self.codes.shape
        groups = (out, inputs // self.group_size)
        if inputs % self.group_size or self.scales.shape != groups or self.biases.shape != groups:
            raise ValueError(f"{self.source}: codes {list(self.codes.shape)} do not match scales "
                             f"{list(self.scales.shape)} and biases {list(self.biases.shape)} in groups of "
                             f"{self.group_size}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """float32 [out, in]."""
        groups = self.codes.reshape(self.shape[0], -1, self.group_size).astype(np.float32)
        return (self.scales[..., None] * groups + self.biases[..., None]).reshape(self.shape)

    def map_rows(self, reorder: Callable[[np.ndarray], np.ndarray]) -> "AffineGroups":
        """The same matrix with its rows rearranged by `reorder` (applied alike to codes, scales and biases)."""
        return AffineGroups(reorder(self.codes), reorder(self.scales), reorder(self.biases), self.bits,
                            self.group_size, self.source, self.sixteen_bit_scales,
                            None if self.factors is None else self.factors.map(reorder))

    def take_rows(self, start: int, end: int) -> "AffineGroups":
        """Outputs [start, end) (a column-parallel slice)."""
        return self.map_rows(lambda t: np.ascontiguousarray(t[start:end]))

    def take_inputs(self, start: int, end: int) -> "AffineGroups":
        """Inputs [start, end) (a row-parallel slice): whole groups only, each keeping its scale and bias."""
        if start % self.group_size or end % self.group_size:
            raise ValueError(f"{self.source}: inputs [{start}, {end}) do not fall on groups of {self.group_size}")
        first, last = start // self.group_size, end // self.group_size
        factors = None if self.factors is None else self.factors.take_groups(first, last)
        return AffineGroups(np.ascontiguousarray(self.codes[:, start:end]),
                            np.ascontiguousarray(self.scales[:, first:last]),
                            np.ascontiguousarray(self.biases[:, first:last]), self.bits, self.group_size, self.source,
                            self.sixteen_bit_scales, factors)

    def same_form(self, other: "AffineGroups") -> bool:
        return (self.bits, self.group_size) == (other.bits, other.group_size) and self.shape[1] == other.shape[1]

    @staticmethod
    def stack(parts: Sequence["AffineGroups"]) -> "AffineGroups":
        """Matrices of one form stacked along their outputs (q, k, v into one projection)."""
        first = parts[0]
        if not all(first.same_form(p) for p in parts):
            raise ValueError("only matrices of one bit width, group size and input size can be stacked")
        source = "+".join(dict.fromkeys(p.source for p in parts))
        return AffineGroups(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                            np.concatenate([p.biases for p in parts]), first.bits, first.group_size, source,
                            all(p.sixteen_bit_scales for p in parts), GroupFactors.stack([p.factors for p in parts]))


def unpack_words(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packed uint32 words [out, in * bits / 32] -> the codes as uint8 [out, in].

    The words hold one little-endian bit stream, least-significant bits first (value j of a 4-bit word is bits
    4j..4j+3), so widths that do not divide 32 (3, 5, 6) run across words."""
    stream = np.ascontiguousarray(packed).view(np.uint8)  # little-endian on every host MLX or torch runs on
    if 8 % bits == 0:  # 2, 4 and 8 bits never straddle a byte
        shifts = np.arange(0, 8, bits, dtype=np.uint8)
        return ((stream[..., None] >> shifts) & ((1 << bits) - 1)).reshape(stream.shape[0], -1)
    single = np.unpackbits(stream, axis=-1, bitorder="little").reshape(stream.shape[0], -1, bits)
    return (single << np.arange(bits, dtype=np.uint8)).sum(-1, dtype=np.uint8)


def pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of unpack_words: codes uint8 [out, in] -> uint32 words [out, in * bits / 32]."""
    out, inputs = codes.shape
    if (inputs * bits) % 32:
        raise ValueError(f"{inputs} inputs of {bits} bits do not fill whole 32-bit words")
    single = ((codes[..., None] >> np.arange(bits, dtype=np.uint8)) & 1).reshape(out, -1)
    return np.packbits(single, axis=-1, bitorder="little").view(np.uint32)


def from_mlx(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int,
             group_size: int, sixteen_bit_scales: bool = True) -> AffineGroups:
    """sixteen_bit_scales: the checkpoint stores scales and biases as float16 or bfloat16 (not float32)."""
    return AffineGroups(unpack_words(packed, bits), np.asarray(scales, dtype=np.float32),
                        np.asarray(biases, dtype=np.float32), bits, group_size, f"mlx {bits}-bit", sixteen_bit_scales)


# An FP4 (E2M1) nibble's value, doubled: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def mxfp4_affine(nibbles: np.ndarray, exponents: np.ndarray, source: str = "mxfp4") -> AffineGroups:
    """MXFP4 values (FP4 nibbles uint8 [out, in], E8M0 exponents uint8 [out, in // 32]: w = fp4 * 2^(e - 127))
    as exact 5-bit affine groups: code = 2 * fp4 + 12 in [0, 24], scale 2^(e - 128), bias -12 * scale (powers of
    two and small integers: exact in every float type, bfloat16 included)."""
    scales = np.ldexp(np.float32(1), exponents.astype(np.int32) - 128).astype(np.float32)
    return AffineGroups((FP4_DOUBLED[nibbles] + 12).astype(np.uint8), scales, -12 * scales, 5, 32, source)


def from_mlx_mxfp4(packed: np.ndarray, exponents: np.ndarray) -> AffineGroups:
    """MLX's (and the Hub's) MXFP4 packing: bytes [out, in / 2], value 2j in the low nibble of byte j."""
    stream = np.ascontiguousarray(packed).view(np.uint8)
    nibbles = np.stack([stream & 0x0F, stream >> 4], axis=-1).reshape(stream.shape[0], -1)
    return mxfp4_affine(nibbles, np.asarray(exponents, dtype=np.uint8), "mxfp4")
