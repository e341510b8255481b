"""GGUF's quantized blocks as AffineGroups (codes, scale and bias per group of 32), for the quantized kernels.

Layouts are ggml's (`ggml-quants.c`; `gguf.quants` decodes the same bytes to floats). Each row of a matrix is
a run of blocks; within a block:
- Q4_0 (18 bytes / 32 values): f16 d, 16 bytes of nibbles (value j in the low nibble of byte j, value 16 + j in
  its high nibble); w = d * (q - 8).
- Q4_1 (20 / 32): f16 d, f16 m, nibbles as Q4_0; w = d * q + m.
- Q5_0 (22 / 32): f16 d, 32 high bits (bit j is value j's fifth bit), nibbles; w = d * (q - 16).
- Q5_1 (24 / 32): f16 d, f16 m, high bits, nibbles; w = d * q + m.
- Q8_0 (34 / 32): f16 d, 32 int8; w = d * q.
- Q4_K (144 / 256): f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (each run of
  32 bytes holds two groups of 32: low nibbles, then high); w = d * scale * q - dmin * min per group of 32.
- Q5_K (176 / 256): as Q4_K, with 32 bytes of fifth bits before the nibbles (bit g of byte j is value j of
  group g's fifth bit).
- MXFP4 (17 / 32, gpt-oss's experts): one byte e, the exponent of a power-of-two scale (E8M0), and nibbles as Q4_0,
  each an FP4 (E2M1) value of {0, 0.5, 1, 1.5, 2, 3, 4, 6} and their negatives. Not affine in 4 bits, but exactly
  so in 5: code = 2 * value + 12 in [0, 24], scale 2^(e - 128), bias -12 scale (powers of two: exact in any float).
- Q6_K (210 / 256): see _q6_k; groups of 16, w = d * scale * (q - 32) with an int8 scale per group.
Q2_K and Q3_K have no decoder here: they are dequantized (gguf.quants).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from exo_like.models.affine import AffineGroups, GroupFactors, mxfp4_affine

GROUP = 32
# What a decoder gives: codes [blocks, values], scales and biases [blocks, groups], bits, and the K-quants' stored
# form of the scales (Factors: scale codes, super scales, bias codes, super biases, zero; see GroupFactors).
Factors = tuple[np.ndarray, np.ndarray, "np.ndarray | None", "np.ndarray | None", int]
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, int, "Factors | None"]


def _halves(d: np.ndarray) -> np.ndarray:
    """Leading f16 fields [blocks, 2] bytes -> float32 [blocks, 1]."""
    return np.ascontiguousarray(d).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32] codes: low nibbles are values 0-15, high nibbles values 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes (one little-endian uint32) -> [blocks, 32] bits: bit j belongs to value j."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> Decoded:
    d = _halves(blocks[:, :2])
    return _nibbles(blocks[:, 2:]), d, -8 * d, 4, None


def _q4_1(blocks: np.ndarray) -> Decoded:
    return _nibbles(blocks[:, 4:]), _halves(blocks[:, :2]), _halves(blocks[:, 2:4]), 4, None


def _q5_0(blocks: np.ndarray) -> Decoded:
    d = _halves(blocks[:, :2])
    return _nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4), d, -16 * d, 5, None


def _q5_1(blocks: np.ndarray) -> Decoded:
    codes = _nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4)
    return codes, _halves(blocks[:, :2]), _halves(blocks[:, 2:4]), 5, None


def _q8_0(blocks: np.ndarray) -> Decoded:
    d = _halves(blocks[:, :2])
    # Signed values -128..127 become codes 0..255 with the offset moved into the bias.
    codes = (np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d, 8, None


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, Factors]:
    """Q4_K / Q5_K superblocks -> per-group scale and bias [blocks, 8] (w = scale * q + bias), and their stored
    form: 6-bit codes times the superblock's d (scales) and dmin (biases, negated)."""
    from gguf.quants import Q4_K  # imported here: gguf.quants takes a quarter of a second to import

    d, dmin = _halves(blocks[:, :2]), _halves(blocks[:, 2:4])
    scale, minimum = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    scale, minimum = scale.astype(np.uint8), minimum.astype(np.uint8)
    factors = (scale, d, minimum, -dmin, 0)
    return d * scale.astype(np.float32), -(dmin * minimum.astype(np.float32)), factors


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] bytes -> [blocks, 8, 32] codes: each 32 bytes are group 2i (low) and 2i+1 (high)."""
    runs = qs.reshape(qs.shape[0], 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(qs.shape[0], 8, 32)


def _q4_k(blocks: np.ndarray) -> Decoded:
    scales, biases, factors = _k_scales(blocks)
    return _k_nibbles(blocks[:, 16:]).reshape(blocks.shape[0], -1), scales, biases, 4, factors


def _q5_k(blocks: np.ndarray) -> Decoded:
    scales, biases, factors = _k_scales(blocks)
    high = blocks[:, 16:48]  # [blocks, 32]: bit g of byte j is group g's value j
    fifth = (high[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = _k_nibbles(blocks[:, 48:]) | (fifth << 4)
    return codes.reshape(blocks.shape[0], -1), scales, biases, 5, factors


def _q6_k(blocks: np.ndarray) -> Decoded:
    """Q6_K (210 bytes / 256): 128 bytes of low nibbles, 64 of top two bits, 16 int8 scales (one per 16 values), f16
    d; w = d * scale * (q - 32). Each half of 128 values takes 64 low-nibble bytes l, 32 top-bit bytes h and 8
    scales: values j, 32 + j, 64 + j, 96 + j (j < 32) are l[j] low, l[32 + j] low, l[j] high, l[32 + j] high
    nibbles, with h[j]'s bits 0-1, 2-3, 4-5, 6-7 on top."""
    low, top = blocks[:, :128], blocks[:, 128:192]
    scale_codes = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8)
    d = _halves(blocks[:, 208:210])
    codes = np.empty((blocks.shape[0], 256), dtype=np.uint8)
    for half in range(2):
        ql, qh, base = low[:, 64 * half:64 * half + 64], top[:, 32 * half:32 * half + 32], 128 * half
        parts = (ql[:, :32] & 0x0F, ql[:, 32:] & 0x0F, ql[:, :32] >> 4, ql[:, 32:] >> 4)
        for quarter, nibbles in enumerate(parts):
            codes[:, base + 32 * quarter:base + 32 * quarter + 32] = nibbles | (((qh >> (2 * quarter)) & 0x03) << 4)
    scales = d * scale_codes.astype(np.float32)
    return codes, scales, -32 * scales, 6, (scale_codes, d, None, None, 32)


def _mxfp4(blocks: np.ndarray) -> Decoded:
    groups = mxfp4_affine(_nibbles(blocks[:, 1:]), blocks[:, :1])
    return groups.codes, groups.scales, groups.biases, 5, None


# type name -> (bytes per block, values per block, decoder, values per group)
DECODERS: dict[str, tuple[int, int, Callable[[np.ndarray], Decoded], int]] = {
    "Q4_0": (18, 32, _q4_0, GROUP),
    "Q4_1": (20, 32, _q4_1, GROUP),
    "Q5_0": (22, 32, _q5_0, GROUP),
    "Q5_1": (24, 32, _q5_1, GROUP),
    "Q8_0": (34, 32, _q8_0, GROUP),
    "Q4_K": (144, 256, _q4_k, GROUP),
    "Q5_K": (176, 256, _q5_k, GROUP),
    "Q6_K": (210, 256, _q6_k, 16),
    "MXFP4": (17, 32, _mxfp4, GROUP),
}


BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "MXFP4": 5}


def group_size(type_name: str) -> int:
    """Values per scale of an affine type."""
    return DECODERS[type_name][3]


def has_affine_form(type_name: str) -> bool:
    return type_name in DECODERS


def affine_groups(type_name: str, stored: np.ndarray, shape: tuple[int, int]) -> AffineGroups:
    """A quantized matrix's bytes (uint8, [out, bytes per row]) -> its codes, and scales and biases per group (with
    the K-quants' stored form of them, GroupFactors)."""
    block_bytes, block_values, decode, size = DECODERS[type_name]
    out, inputs = shape
    blocks = np.asarray(stored, dtype=np.uint8).reshape(-1, block_bytes)
    codes, scales, biases, bits, factors = decode(blocks)
    groups = (out, inputs // size)
    if factors is not None:
        scale_codes, super_scales, bias_codes, super_biases, zero = factors
        per_super = block_values // size
        supers = (out, inputs // block_values)
        factors = GroupFactors(scale_codes.reshape(groups), super_scales.reshape(supers),
                               None if bias_codes is None else bias_codes.reshape(groups),
                               None if super_biases is None else super_biases.reshape(supers), zero, per_super)
    return AffineGroups(codes.astype(np.uint8, copy=False).reshape(out, inputs), scales.reshape(groups),
                        biases.reshape(groups), bits, size, type_name, factors=factors)
