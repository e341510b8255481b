// The quantized product with AVX-512 VNNI (Intel from Cascade Lake / Ice Lake on, AMD from Zen 4): the same
// integer sums as quant.cpp's kernels, computed sixteen weight rows at a time. The matrix's rows are stored
// interleaved in blocks of 16 (quant.h's Matrix, matrix.py's interleave): four code bytes of each of the block's
// rows side by side fill one 512-bit register, one 32-bit lane a row, and `vpdpbusd` multiplies each lane's four
// codes by four activations broadcast to every lane and adds the four products into the lane. So a block of 32
// inputs costs 16 such instructions for all sixteen rows, its scale is applied to a register of sixteen rows' sums
// at once, and each output's total ends in its own lane: no horizontal sum, one store for sixteen outputs.
//
// The activations are the same int16 codes as the other kernels' (16 bits: see quant.cpp); vpdpbusd takes bytes,
// so each code is split as q = 256 * hi + lo (hi signed, lo unsigned, quantize_into) and a block's exact integer
// sum is 256 * sum(w * hi) + sum(w * lo), the weight codes the unsigned operand of the first product and the
// signed one of the second (codes of up to 6 bits fit either; 8-bit codes are taken as w - 128, and 128 * sum(lo)
// added back). The float32 work per block is that of the other kernels, in another order: the block's (or half
// block's) integer sum times scale * d, summed over blocks in two chains (even and odd blocks), then the biases.
// Each activation row is computed by the same instructions whatever the number of rows beside it (batch-invariant).

#include <torch/extension.h>

#include "quant.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXO_X86 1
#endif

namespace exo {
namespace {

#ifdef EXO_X86
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

// Factors of group g for the block of rows [first, first + width), one lane a row (lanes past width: 0).
VNNI inline __m512 factor_lanes(const Factors& f, const Matrix& m, int64_t first, int64_t width, int64_t g,
                                __mmask16 mask) {
  const int64_t i = first * m.groups + g * width;
  switch (f.type) {
    case F32: return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(f.values) + i);
    case F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(f.values) + i));
    case BF16: {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(f.values) + i);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    default: {  // 8-bit codes times their super-block's float32, as Factors::at computes them
      const __m128i raw = _mm_maskz_loadu_epi8(mask, static_cast<const uint8_t*>(f.values) + i);
      const __m512i wide = f.type == U8_CODES ? _mm512_cvtepu8_epi32(raw) : _mm512_cvtepi8_epi32(raw);
      const int64_t s = first * (m.groups >> f.shift) + (g >> f.shift) * width;
      return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_maskz_loadu_ps(mask, f.supers + s));
    }
  }
}

VNNI inline __m512i broadcast4(const void* bytes) {
  int32_t v;
  std::memcpy(&v, bytes, 4);
  return _mm512_set1_epi32(v);
}

// Top two bits of codes from a register of high bytes (byte j = h[j] | h[j + 8] << 2 | ...): those at `shift`,
// moved to bits 4 and 5 of each byte.
template <int S>
VNNI inline __m512i top_bits(__m512i high) {
  const __m512i mask = _mm512_set1_epi32(0x30303030);
  if constexpr (S <= 4) return _mm512_and_si512(_mm512_slli_epi32(high, 4 - S), mask);
  return _mm512_and_si512(_mm512_srli_epi32(high, S - 4), mask);
}

// Block b's codes for the block of rows: q[k] holds inputs 4k .. 4k + 3 of each row, a lane a row.
template <int64_t L>
VNNI inline void block_codes(const Matrix& m, int64_t first, int64_t width, int64_t b, __mmask16 mask, __m512i* q) {
  constexpr int64_t units = L == BYTES ? 8 : 4;  // 4-byte units of codes a row's block
  const int32_t* low = reinterpret_cast<const int32_t*>(m.low) + first * (m.low_stride() / 4) + b * units * width;
  // The codes PREFETCH_BYTES ahead: a block of 16 rows' codes is `units` cache lines in a row (one unit of 16 rows
  // a line), so the lines are addressed from one pointer (offsets from the block's own unit addresses took a
  // register each, and the kernel ran out of them).
  const char* ahead = reinterpret_cast<const char*>(low) + PREFETCH_BYTES;
#pragma GCC unroll 8
  for (int64_t t = 0; t < units; ++t) _mm_prefetch(ahead + 64 * t, _MM_HINT_T0);
  if constexpr (L == BYTES) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) q[t] = _mm512_maskz_loadu_epi32(mask, low + t * width);
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
  for (int t = 0; t < 4; ++t) {  // byte j = q[j] | q[j + 16] << 4: unit t holds inputs 4t.. and 16 + 4t..
    const __m512i v = _mm512_maskz_loadu_epi32(mask, low + t * width);
    q[t] = _mm512_and_si512(v, nibble);
    q[4 + t] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
  }
  if constexpr (L == HIGH2) {
    const int32_t* high = reinterpret_cast<const int32_t*>(m.high) + first * (m.inputs / 16) + b * 2 * width;
    const __m512i h0 = _mm512_maskz_loadu_epi32(mask, high), h1 = _mm512_maskz_loadu_epi32(mask, high + width);
    // inputs 0-3 and 16-19 in high bytes 0-3 (bits 0-1, 4-5), 4-7 and 20-23 in bytes 4-7, 8-11 / 24-27 in bytes
    // 0-3 (bits 2-3, 6-7), 12-15 / 28-31 in bytes 4-7
    q[0] = _mm512_or_si512(q[0], top_bits<0>(h0));
    q[4] = _mm512_or_si512(q[4], top_bits<4>(h0));
    q[2] = _mm512_or_si512(q[2], top_bits<2>(h0));
    q[6] = _mm512_or_si512(q[6], top_bits<6>(h0));
    q[1] = _mm512_or_si512(q[1], top_bits<0>(h1));
    q[5] = _mm512_or_si512(q[5], top_bits<4>(h1));
    q[3] = _mm512_or_si512(q[3], top_bits<2>(h1));
    q[7] = _mm512_or_si512(q[7], top_bits<6>(h1));
  }
}

// One activation row's exact integer sums over block b's two halves (inputs 0-15, 16-31), a lane a weight row.
template <int64_t L>
VNNI inline void half_sums(const __m512i* q, const int8_t* hi, const uint8_t* lo, __m512i& first_half,
                           __m512i& second_half) {
  __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 4
  for (int k = 0; k < 4; ++k) {
    const __m512i s0 = L == BYTES ? _mm512_xor_si512(q[k], flip) : q[k];  // the codes as signed bytes
    const __m512i s1 = L == BYTES ? _mm512_xor_si512(q[4 + k], flip) : q[4 + k];
    h0 = _mm512_dpbusd_epi32(h0, q[k], broadcast4(hi + 4 * k));
    l0 = _mm512_dpbusd_epi32(l0, broadcast4(lo + 4 * k), s0);
    h1 = _mm512_dpbusd_epi32(h1, q[4 + k], broadcast4(hi + 16 + 4 * k));
    l1 = _mm512_dpbusd_epi32(l1, broadcast4(lo + 16 + 4 * k), s1);
  }
  first_half = _mm512_add_epi32(_mm512_slli_epi32(h0, 8), l0);
  second_half = _mm512_add_epi32(_mm512_slli_epi32(h1, 8), l1);
}

// Block b of the block of rows against activation rows [r0, r0 + C), into their chains.
template <int64_t L, bool HALVES, int C>
VNNI inline void block_step(const Matrix& m, const Activations& a, int64_t first, int64_t width, int64_t r0,
                            int64_t b, int shift, __mmask16 mask, __m512* chain) {
  __m512i q[8];
  block_codes<L>(m, first, width, b, mask, q);
  const __m512 s0 = factor_lanes(m.scales, m, first, width, HALVES ? 2 * b : b >> shift, mask);
  const __m512 s1 = HALVES ? factor_lanes(m.scales, m, first, width, 2 * b + 1, mask) : s0;
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const int64_t at = (r0 + c) * a.inputs + b * BLOCK;
    __m512i lo_half, hi_half;
    half_sums<L>(q, a.hi + at, a.lo + at, lo_half, hi_half);
    const __m512 d = _mm512_set1_ps(a.d[(r0 + c) * a.blocks + b]);
    if constexpr (HALVES) {
      chain[c] = _mm512_fmadd_ps(_mm512_mul_ps(s0, d), _mm512_cvtepi32_ps(lo_half), chain[c]);
      chain[c] = _mm512_fmadd_ps(_mm512_mul_ps(s1, d), _mm512_cvtepi32_ps(hi_half), chain[c]);
    } else {
      __m512i sum = _mm512_add_epi32(lo_half, hi_half);
      if constexpr (L == BYTES) {  // the codes were taken as w - 128
        sum = _mm512_add_epi32(sum, _mm512_set1_epi32(128 * a.lo_sum[(r0 + c) * a.blocks + b]));
      }
      chain[c] = _mm512_fmadd_ps(_mm512_mul_ps(s0, d), _mm512_cvtepi32_ps(sum), chain[c]);
    }
  }
}

// Weight rows [first, first + width) (one interleaved block) against activation rows [r0, r0 + C).
template <int64_t L, bool HALVES, int C>
VNNI void rows_vnni_tile(const Matrix& m, const Activations& a, int64_t first, int64_t width, int64_t r0,
                         float* out, int64_t out_stride) {
  const __mmask16 mask = width >= ROW_BLOCK ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1);
  const int shift = HALVES ? 0 : __builtin_ctzll(m.group / BLOCK);  // log2 of blocks per group
  __m512 even[C], odd[C];  // even and odd blocks: two chains of dependent multiply-adds
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < a.blocks; b += 2) {
    block_step<L, HALVES, C>(m, a, first, width, r0, b, shift, mask, even);
    block_step<L, HALVES, C>(m, a, first, width, r0, b + 1, shift, mask, odd);
  }
  if (b < a.blocks) block_step<L, HALVES, C>(m, a, first, width, r0, b, shift, mask, even);
  // The biases: sum over groups of bias * the group's activation sum (symmetric: -zero * sum of scale * sum).
  const Factors& f = m.biases.values ? m.biases : m.scales;
  __m512 sums[C];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) sums[c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < m.groups; ++g) {
    const __m512 lanes = factor_lanes(f, m, first, width, g, mask);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      sums[c] = _mm512_fmadd_ps(lanes, _mm512_set1_ps(a.gsum[(r0 + c) * m.groups + g]), sums[c]);
    }
  }
  const __m512 factor = _mm512_set1_ps(m.biases.values ? 1.0f : -m.zero);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    const __m512 total = _mm512_add_ps(_mm512_add_ps(even[c], odd[c]), _mm512_mul_ps(factor, sums[c]));
    _mm512_mask_storeu_ps(out + (r0 + c) * out_stride + first, mask, total);
  }
}

template <int64_t L, bool HALVES>
void rows_vnni(const Matrix& m, const Activations& a, int64_t first, int64_t last, int64_t r0, int64_t count,
               float* out, int64_t out_stride) {
  TORCH_CHECK(m.interleaved && first % ROW_BLOCK == 0 && last - first <= ROW_BLOCK && a.hi != nullptr,
              "the VNNI kernel takes one interleaved block of rows and split activations");
  const int64_t width = last - first;
  switch (count) {
    case 1: return rows_vnni_tile<L, HALVES, 1>(m, a, first, width, r0, out, out_stride);
    case 2: return rows_vnni_tile<L, HALVES, 2>(m, a, first, width, r0, out, out_stride);
    case 3: return rows_vnni_tile<L, HALVES, 3>(m, a, first, width, r0, out, out_stride);
    default: return rows_vnni_tile<L, HALVES, 4>(m, a, first, width, r0, out, out_stride);
  }
}
#endif

}  // namespace

RowKernel vnni_kernel(int64_t layout, bool halves) {
#ifdef EXO_X86
  if (halves) return layout == NIBBLES ? rows_vnni<NIBBLES, true> : rows_vnni<HIGH2, true>;
  if (layout == NIBBLES) return rows_vnni<NIBBLES, false>;
  if (layout == HIGH2) return rows_vnni<HIGH2, false>;
  return rows_vnni<BYTES, false>;
#else
  TORCH_CHECK(false, "the VNNI kernel needs an x86-64 CPU");
  return nullptr;
#endif
}

}  // namespace exo
