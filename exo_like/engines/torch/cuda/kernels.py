"""Triton kernels for quantized matrices held as the native kernels pack them (engines/torch/native/matrix.py, rows
not interleaved): codes at their own width (NIBBLES: per block of 32 inputs, byte j = q[j] | q[j + 16] << 4; HIGH2:
those nibbles plus the top two bits, byte j = h[j] | h[j + 8] << 2 | h[j + 16] << 4 | h[j + 24] << 6; BYTES), and
per group of inputs a scale and a bias in one of three forms (FACTORS): 16-bit scales and biases (HALF), 16-bit
scales with bias = -zero * scale (SYMMETRIC), or K-quants' byte codes times a float32 a super-block (K, and
K_SYMMETRIC without bias codes).

`affine_matmul` computes out = x @ w.T one [BLOCK_M, BLOCK_N] tile at a time: each [BLOCK_N, BLOCK_K] tile of w is
dequantized in float32 from its codes and factors, rounded to x's dtype (bfloat16 on a quantized CUDA node) and
multiplied on the tensor cores with float32 sums; the result is rounded once to x's dtype. Its error against exact
arithmetic: the activations' and the weights' roundings to that dtype (2^-9 relative each, for bfloat16), the
float32 sums' and the one rounding of the result. One kernel for prompts and decode steps: rows of a decode step
fill the tile's first rows (the rest masked), the tile's weights are read once for all of them.

Runs on CUDA, and under Triton's interpreter (TRITON_INTERPRET=1, before triton is imported) on CPU tensors, which
is how the suite tests it where there is no GPU."""

from __future__ import annotations

import triton
import triton.language as tl

NIBBLES, HIGH2, BYTES = 0, 1, 2  # as engines/torch/native/matrix.py
HALF, SYMMETRIC, K, K_SYMMETRIC = 0, 1, 2, 3


@triton.jit
def _codes(lo_ptr, hi_ptr, rn, rk, mask, K_IN, LAYOUT: tl.constexpr):
    """Codes [BLOCK_N, BLOCK_K] of rows rn at inputs rk (0 outside `mask`), as int32."""
    r = rk % 32
    block = rk // 32
    if LAYOUT == 2:
        return tl.load(lo_ptr + rn[:, None] * K_IN + rk[None, :], mask=mask, other=0).to(tl.int32)
    low = tl.load(lo_ptr + rn[:, None] * (K_IN // 2) + (block * 16 + r % 16)[None, :], mask=mask,
                  other=0).to(tl.int32)
    q = (low >> (4 * (r // 16))[None, :]) & 15
    if LAYOUT == 1:
        high = tl.load(hi_ptr + rn[:, None] * (K_IN // 4) + (block * 8 + r % 8)[None, :], mask=mask,
                       other=0).to(tl.int32)
        q = q | (((high >> (2 * (r // 8))[None, :]) & 3) << 4)
    return q


@triton.jit
def _factors(s_ptr, b_ptr, ss_ptr, sb_ptr, rn, rk, mask, K_IN, zero, GROUP: tl.constexpr,
             PER_SUPER: tl.constexpr, FACTORS: tl.constexpr):
    """Scales and biases [BLOCK_N, BLOCK_K] (each input's group's; 0 outside `mask`), float32."""
    groups = K_IN // GROUP
    g = rk // GROUP
    at = rn[:, None] * groups + g[None, :]
    scale = tl.load(s_ptr + at, mask=mask, other=0).to(tl.float32)
    if FACTORS >= 2:  # K-quants: a code a group times a float32 a super-block
        supers = groups // PER_SUPER
        at_super = rn[:, None] * supers + (g // PER_SUPER)[None, :]
        scale = scale * tl.load(ss_ptr + at_super, mask=mask, other=0)
        if FACTORS == 2:
            bias = tl.load(b_ptr + at, mask=mask, other=0).to(tl.float32) * \
                tl.load(sb_ptr + at_super, mask=mask, other=0)
        else:
            bias = -zero * scale
    elif FACTORS == 0:
        bias = tl.load(b_ptr + at, mask=mask, other=0).to(tl.float32)
    else:
        bias = -zero * scale
    return scale, bias


@triton.jit
def affine_matmul(x_ptr, lo_ptr, hi_ptr, s_ptr, b_ptr, ss_ptr, sb_ptr, out_ptr, M, N, K_IN, zero,
                  LAYOUT: tl.constexpr, FACTORS: tl.constexpr, GROUP: tl.constexpr, PER_SUPER: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out [M, N] = x [M, K_IN] @ w.T, x and out contiguous."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_IN, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K_IN  # (inputs come in blocks of 32, not always of BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * K_IN + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        mask = n_mask[:, None] & k_mask[None, :]
        q = _codes(lo_ptr, hi_ptr, rn, rk, mask, K_IN, LAYOUT)
        scale, bias = _factors(s_ptr, b_ptr, ss_ptr, sb_ptr, rn, rk, mask, K_IN, zero, GROUP, PER_SUPER, FACTORS)
        w = (scale * q.to(tl.float32) + bias).to(x.dtype)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def launch(x, matrix, out, block_m: int, block_n: int, block_k: int) -> None:  # noqa: ANN001
    """out = x @ matrix.T for a GpuMatrix (matrix.py)."""
    rows, inputs = x.shape
    outputs = matrix.shape[0]
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outputs, block_n))
    affine_matmul[grid](x, matrix.low, matrix.high, matrix.scales, matrix.biases, matrix.super_scales,
                        matrix.super_biases, out, rows, outputs, inputs, float(matrix.zero), LAYOUT=matrix.layout,
                        FACTORS=matrix.factors, GROUP=matrix.group_size, PER_SUPER=matrix.per_super,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
