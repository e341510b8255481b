// Quantized matrix products on CPU from affine groups' stored codes (w = scale * q + bias per group of inputs),
// in the manner of llama.cpp's quantized types: the activations are quantized per block of 32 inputs (one float
// scale a block), each block's integer dot product with the codes is exact, and it is scaled once per block in
// float32. Activations are quantized to 16 bits, not llama.cpp's 8: SmolLM2's hidden states carry outliers of
// 20-30 times their RMS, and with 8 bits the rest of such a block keeps 3-4 bits, which cost 2 % of perplexity
// here; 16 bits cost nothing measurable, and the same number of multiplies (two 16-bit multiply-adds a block
// instead of an 8-bit one and its widening).
//
// Code layouts (per row, per block of 32 inputs; see matrix.py, which packs them):
//   NIBBLES (codes of up to 4 bits): 16 bytes, byte j = q[j] | q[j + 16] << 4.
//   HIGH2 (5 or 6 bits): the low nibbles as above, plus 8 bytes of the codes' top two bits,
//     byte j = h[j] | h[j + 8] << 2 | h[j + 16] << 4 | h[j + 24] << 6.
//   BYTES (7 or 8 bits): 32 bytes, one code each.
// Scales (and biases) per group are float32, float16 or bfloat16, as the checkpoint stores them, or as K-quants
// store them: an 8-bit code a group times a float32 a super-block (scale = code * super, in float32, which is how
// the file's decoder computes it); a symmetric type (Q4_0, Q8_0, MXFP4, Q6_K: bias = -zero * scale) keeps no
// biases.
//
// Each output is the float32 sum over groups g of scale_g * sum_blocks(d_b * isum_b) + bias_g * xsum_g, where
// isum_b is the block's exact integer dot product, d_b the activations' block scale and xsum_g the float32
// sum of the group's activations. Rows of a batch do not interact: a row's result is the same in any batch.
//
// ISA, chosen once per process (native_isa): AVX-512 VNNI (vnni.cpp, on rows stored interleaved by 16), else an
// AVX2 + FMA + F16C kernel (here), else a portable one; all compute the same integer sums, their float32
// accumulation order differs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "quant.h"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXO_X86 1
#endif

namespace exo {
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& w);  // half.cpp: oneDNN's where present

// Which code the native kernels run (quant.h): the best the CPU has, unless EXO_LIKE_NATIVE_ISA asks for a lower
// one ("avx2", "portable"). Every kernel file asks here, so one process runs one kind throughout, and matrix.py packs
// its matrices for that kind (interleaved for AVX-512).
Isa native_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  static const Isa isa = [] {
    const char* asked = std::getenv("EXO_LIKE_NATIVE_ISA");
    const std::string cap = asked == nullptr ? "" : asked;
    if (cap == "portable") return Isa::PORTABLE;
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) {
      return Isa::PORTABLE;
    }
    const bool vnni = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return vnni && cap != "avx2" ? Isa::AVX512 : Isa::AVX2;
  }();
  return isa;
#else
  return Isa::PORTABLE;
#endif
}

bool native_avx2() { return native_isa() != Isa::PORTABLE; }
bool native_avx512() { return native_isa() == Isa::AVX512; }
}  // namespace exo

namespace {

using namespace exo;  // quant.h: the shared types

constexpr int64_t ROW_TILE = 4;      // activation rows per pass over a weight row
constexpr int64_t WEIGHT_BLOCK = ROW_BLOCK;  // weight rows a thread holds while the activation rows pass
constexpr float CODE_MAX = 32767.0f; // activations' codes: int16
constexpr int64_t GEMM_ROWS = 32;     // from this many rows, dequantized weights and a float32 GEMM (measured)
constexpr int64_t GEMM_CHUNK = 1024;  // outputs dequantized at a time (bounds the float32 copy)

// Where a product's quantized activations are kept (resized by quantize_into).
struct Scratch {
  std::vector<int16_t> q;
  std::vector<float> floats;    // block scales, then group sums
  std::vector<uint8_t> bytes;   // VNNI: the codes' hi bytes, then their lo bytes
  std::vector<int32_t> lo_sums;  // VNNI: per block, the sum of its lo bytes
};

// A block of 32 activations as int16 codes: scale d = max|v| / 32767, q = round-half-even(v * (1 / d)); returns d.
float quantize_block(const float* v, int16_t* q) {
  float amax = 0.0f;
  for (int64_t i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(v[i]));
  const float scale = amax / CODE_MAX;
  const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < BLOCK; ++i) q[i] = static_cast<int16_t>(std::nearbyint(v[i] * inverse));
  return scale;
}

// A block's codes split in bytes for the VNNI kernel, q = 256 * hi + lo (0 <= lo < 256); returns the sum of lo.
int32_t split_block(const int16_t* q, int8_t* hi, uint8_t* lo) {
  int32_t sum = 0;
  for (int64_t i = 0; i < BLOCK; ++i) {
    hi[i] = static_cast<int8_t>(q[i] >> 8);  // an arithmetic shift
    lo[i] = static_cast<uint8_t>(q[i] & 0xFF);
    sum += lo[i];
  }
  return sum;
}

#ifdef EXO_X86
// quantize_block with eight lanes: the same maximum, scale, products and rounding (the CPU's round-to-nearest-even,
// which std::nearbyint uses), so the same codes.
__attribute__((target("avx2,fma,f16c"))) float quantize_block_avx2(const float* v, int16_t* q) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 values[4], amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    values[i] = _mm256_loadu_ps(v + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(values[i], magnitude));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float scale = _mm_cvtss_f32(m) / CODE_MAX;
  const __m256 inverse = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
  for (int i = 0; i < 2; ++i) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(values[2 * i], inverse));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(values[2 * i + 1], inverse));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // packs works per 128 bits
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * i), packed);
  }
  return scale;
}

__attribute__((target("avx2,fma,f16c"))) int32_t split_block_avx2(const int16_t* q, int8_t* hi, uint8_t* lo) {
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16));
  const __m256i bytes = _mm256_set1_epi16(0xFF);
  const __m256i high = _mm256_packs_epi16(_mm256_srai_epi16(q0, 8), _mm256_srai_epi16(q1, 8));
  const __m256i low = _mm256_packus_epi16(_mm256_and_si256(q0, bytes), _mm256_and_si256(q1, bytes));
  const __m256i l = _mm256_permute4x64_epi64(low, 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), _mm256_permute4x64_epi64(high, 0xD8));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), l);
  const __m256i sums = _mm256_sad_epu8(l, _mm256_setzero_si256());  // four 64-bit sums of eight bytes
  return static_cast<int32_t>(_mm256_extract_epi64(sums, 0) + _mm256_extract_epi64(sums, 1) +
                              _mm256_extract_epi64(sums, 2) + _mm256_extract_epi64(sums, 3));
}
#endif

// The activations quantized into `scratch`; with their bytes split for the VNNI kernel where it runs.
Activations quantize_into(const at::Tensor& x, int64_t group, Scratch& scratch) {
  Activations a;
  a.rows = x.size(0);
  a.inputs = x.size(1);
  a.blocks = a.inputs / BLOCK;
  a.groups = a.inputs / group;
  const bool split = native_isa() == Isa::AVX512;
  scratch.q.resize(a.rows * a.inputs);
  scratch.floats.resize(a.rows * (a.blocks + a.groups));
  scratch.bytes.resize(split ? 2 * a.rows * a.inputs : 0);
  scratch.lo_sums.resize(split ? a.rows * a.blocks : 0);
  const float* xs = x.data_ptr<float>();
  int16_t* q = scratch.q.data();
  float* d = scratch.floats.data();
  float* gsum = d + a.rows * a.blocks;
  int8_t* hi = reinterpret_cast<int8_t*>(scratch.bytes.data());
  uint8_t* lo = scratch.bytes.data() + a.rows * a.inputs;
  a.q = q;
  a.d = d;
  a.gsum = gsum;
  if (split) a.hi = hi, a.lo = lo, a.lo_sum = scratch.lo_sums.data();
  const bool vector = native_avx2();
  at::parallel_for(0, a.rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < a.blocks; ++b) {
        const int64_t at = r * a.inputs + b * BLOCK;
#ifdef EXO_X86
        if (vector) {
          d[r * a.blocks + b] = quantize_block_avx2(xs + at, q + at);
          if (split) scratch.lo_sums[r * a.blocks + b] = split_block_avx2(q + at, hi + at, lo + at);
          continue;
        }
#endif
        d[r * a.blocks + b] = quantize_block(xs + at, q + at);
        if (split) scratch.lo_sums[r * a.blocks + b] = split_block(q + at, hi + at, lo + at);
      }
      for (int64_t g = 0; g < a.groups; ++g) {
        const float* v = xs + r * a.inputs + g * group;
        float sum = 0.0f;
        for (int64_t i = 0; i < group; ++i) sum += v[i];
        gsum[r * a.groups + g] = sum;
      }
    }
  });
  return a;
}

// Into thread-local scratch, valid until the thread's next product.
Activations quantize(const at::Tensor& x, int64_t group) {
  thread_local Scratch scratch;
  return quantize_into(x, group, scratch);
}

// Block b of `row`: its 32 codes, from either storage (row-major, or interleaved in 4-byte units).
void codes_of_block(const Matrix& m, int64_t row, int64_t b, uint8_t* codes) {
  uint8_t low[BLOCK], high[8];
  const int64_t units = m.layout == BYTES ? 8 : 4;  // 4-byte units of codes a block
  for (int64_t t = 0; t < units; ++t) {
    std::memcpy(low + 4 * t, m.low + 4 * m.unit(row, b * units + t, m.low_stride() / 4), 4);
  }
  if (m.layout == BYTES) {
    std::memcpy(codes, low, BLOCK);
    return;
  }
  for (int j = 0; j < 16; ++j) {
    codes[j] = low[j] & 0x0F;
    codes[j + 16] = low[j] >> 4;
  }
  if (m.layout == HIGH2) {
    for (int64_t t = 0; t < 2; ++t) std::memcpy(high + 4 * t, m.high + 4 * m.unit(row, b * 2 + t, m.inputs / 16), 4);
    for (int j = 0; j < BLOCK; ++j) codes[j] |= ((high[j % 8] >> (2 * (j / 8))) & 0x03) << 4;
  }
}

// Row `row` dequantized into out[0, inputs): scale * q + bias, a product then a sum (never fused: built with
// -ffp-contract=off), as numpy's AffineGroups.dequantize rounds them.
void dequantize_row(const Matrix& m, int64_t row, float* out) {
  uint8_t codes[BLOCK];
  for (int64_t b = 0; b < m.inputs / BLOCK; ++b) {
    codes_of_block(m, row, b, codes);
    for (int half = 0; half < 2; ++half) {
      const int64_t g = (b * BLOCK + half * 16) / m.group;
      const float scale = m.scale(row, g), bias = m.bias(row, g);
      float* o = out + b * BLOCK + half * 16;
      for (int j = 0; j < 16; ++j) {
        const float product = scale * static_cast<float>(codes[half * 16 + j]);
        o[j] = product + bias;
      }
    }
  }
}

// Each block's codes decoded once for the tile's rows (at most ROW_TILE); each row's sums in the same order as alone.
void row_portable(const Matrix& m, const Activations& a, int64_t row, int64_t r0, int64_t count, float* out,
                  int64_t out_stride) {
  float totals[ROW_TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
  uint8_t codes[BLOCK];
  for (int64_t b = 0; b < a.blocks; ++b) {
    codes_of_block(m, row, b, codes);
    const float scales[2] = {m.scale(row, b * BLOCK / m.group), m.scale(row, (b * BLOCK + 16) / m.group)};
    for (int64_t t = 0; t < count; ++t) {
      const int16_t* xq = a.q + (r0 + t) * a.inputs + b * BLOCK;
      int32_t halves[2] = {0, 0};
      for (int64_t j = 0; j < BLOCK; ++j) halves[j / 16] += codes[j] * xq[j];
      const float d = a.d[(r0 + t) * a.blocks + b];
      for (int64_t half = 0; half < 2; ++half) totals[t] += scales[half] * d * static_cast<float>(halves[half]);
    }
  }
  for (int64_t t = 0; t < count; ++t) {
    const float* gsum = a.gsum + (r0 + t) * a.groups;
    float total = totals[t];
    for (int64_t g = 0; g < m.groups; ++g) total += m.bias(row, g) * gsum[g];
    out[(r0 + t) * out_stride + row] = total;
  }
}

// Weight rows [first, last) against activation rows [r0, r0 + count).
void rows_portable(const Matrix& m, const Activations& a, int64_t first, int64_t last, int64_t r0, int64_t count,
                   float* out, int64_t out_stride) {
  for (int64_t row = first; row < last; ++row) row_portable(m, a, row, r0, count, out, out_stride);
}

#ifdef EXO_X86
__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A block's 32 codes as unsigned bytes, in two halves: codes 0-15 and 16-31 (each widened to 16 bits on its own,
// so no 256-bit vector is built only to be split again).
struct Halves {
  __m128i lo, hi;
};

template <int64_t L>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline Halves block_codes(const uint8_t* low,
                                                                                   const uint8_t* high) {
  if constexpr (L == BYTES) {
    return {_mm_loadu_si128(reinterpret_cast<const __m128i*>(low)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(low + 16))};
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(low));
    const __m128i mask = _mm_set1_epi8(0x0F);
    Halves codes{_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask)};
    if constexpr (L == HIGH2) {
      int64_t bits;
      std::memcpy(&bits, high, 8);
      const __m128i all = _mm_set1_epi64x(bits), two = _mm_set1_epi8(0x03);
      const __m128i h_lo = _mm_srlv_epi64(all, _mm_set_epi64x(2, 0)), h_hi = _mm_srlv_epi64(all, _mm_set_epi64x(6, 4));
      codes.lo = _mm_or_si128(codes.lo, _mm_slli_epi16(_mm_and_si128(h_lo, two), 4));
      codes.hi = _mm_or_si128(codes.hi, _mm_slli_epi16(_mm_and_si128(h_hi, two), 4));
    }
    return codes;
  }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline float load_factor(const Factors& f, int64_t i) {
  if (f.type == F32) return static_cast<const float*>(f.values)[i];
  if (f.type == F16) return _cvtsh_ss(static_cast<const uint16_t*>(f.values)[i]);
  return f.at(i);
}

// group_sum (below) against C activation rows at once (v: row t's sums at v + t * stride), each the same
// arithmetic as group_sum for that row alone; the factors are loaded and widened once for all C.
template <int C>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void group_sums(const Factors& f, int64_t groups,
                                                                                int64_t first, const float* v,
                                                                                int64_t stride, int stored_type,
                                                                                float* out) {
  int64_t g = 0;
#pragma GCC unroll 4
  for (int t = 0; t < C; ++t) out[t] = 0.0f;
  if (stored_type < U8_CODES && f.type <= BF16) {  // eight lanes
    __m256 acc[C];
#pragma GCC unroll 4
    for (int t = 0; t < C; ++t) acc[t] = _mm256_setzero_ps();
    for (; g + 8 <= groups; g += 8) {
      __m256 w;
      if (f.type == F32) {
        w = _mm256_loadu_ps(static_cast<const float*>(f.values) + first + g);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(f.values) +
                                                                           first + g));
        w = f.type == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
#pragma GCC unroll 4
      for (int t = 0; t < C; ++t) acc[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + t * stride + g), acc[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < C; ++t) out[t] = hsum(acc[t]);
  }
  for (; g < groups; ++g) {
    const float w = load_factor(f, first + g);
#pragma GCC unroll 4
    for (int t = 0; t < C; ++t) out[t] += w * v[t * stride + g];
  }
}

// sum_g f[first + g] * v[g] over a row's groups (f: the row's factors as row_factors gives them): eight lanes
// where the factors are 16- or 32-bit floats, then the rest one by one; K-quants' (stored as codes) summed group by
// group in order, as the kernel summed them before they were expanded per row (their results stay what they were).
__attribute__((target("avx2,fma,f16c"), always_inline)) inline float group_sum(const Factors& f, int64_t groups,
                                                                                int64_t first, const float* v,
                                                                                int stored_type) {
  float total;
  group_sums<1>(f, groups, first, v, 0, stored_type, &total);
  return total;
}

// Block b of a weight row against C activation rows, into their accumulators (indices known at compile time, so
// they stay in registers). Groups of 16 (HALVES) scale each half block on its own.
template <int64_t L, int C, bool HALVES>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void block_step(
    const uint8_t* low, const uint8_t* high, const int16_t* xq, const float* d, int64_t inputs, int64_t blocks,
    int64_t b, float scale_lo, float scale_hi, __m256* acc) {
  const Halves codes = block_codes<L>(low + b * (L == BYTES ? 32 : 16), L == HIGH2 ? high + b * 8 : nullptr);
  const __m256i lo = _mm256_cvtepu8_epi16(codes.lo);
  const __m256i hi = _mm256_cvtepu8_epi16(codes.hi);
#pragma GCC unroll 4
  for (int t = 0; t < C; ++t) {
    const int16_t* x = xq + t * inputs + b * BLOCK;
    const __m256i p0 = _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m256i p1 = _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
    const float db = d[t * blocks + b];
    if constexpr (HALVES) {
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale_lo * db), _mm256_cvtepi32_ps(p0), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale_hi * db), _mm256_cvtepi32_ps(p1), acc[t]);
    } else {
      acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(scale_lo * db), _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), acc[t]);
    }
  }
}

// A row's factors as float32, `first` their index in `f`: bfloat16 values widened and K-quants' codes times their
// super-block's float32 (as Factors::at computes them) once per row, not once per block and activation row (a
// call per block made groups of 16 ten times slower). float32 and float16 ones are read in place.
struct RowFactors {
  Factors factors;
  int64_t first;
};

// Codes [first, first + n) times their super-blocks' float32 (Factors::at's products), eight at a time where eight
// codes share one super-block (shift >= 3, aligned), as the K-quants' are: a scalar loop with the super-block's
// index per code took a fifth of a mixture's decode step.
template <typename Code>
__attribute__((target("avx2,fma,f16c"))) void expand_codes(const Code* codes, const float* supers, int shift,
                                                            int64_t first, int64_t n, float* out) {
  int64_t g = 0;
  if (shift >= 3 && first % 8 == 0) {
    for (; g + 8 <= n; g += 8) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + first + g));
      const __m256i wide = std::is_signed_v<Code> ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
      _mm256_storeu_ps(out + g, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set1_ps(supers[(first + g) >> shift])));
    }
  }
  for (; g < n; ++g) out[g] = static_cast<float>(codes[first + g]) * supers[(first + g) >> shift];
}

__attribute__((target("avx2,fma,f16c"))) RowFactors row_factors(const Factors& f, int64_t first, int64_t groups,
                                                                 std::vector<float>& buffer) {
  if (f.type == F32 || f.type == F16 || f.values == nullptr) return {f, first};
  buffer.resize(groups);
  float* out = buffer.data();
  if (f.type == BF16) {
    for (int64_t g = 0; g < groups; ++g) out[g] = bfloat_to_float(static_cast<const uint16_t*>(f.values)[first + g]);
  } else if (f.type == U8_CODES) {
    expand_codes(static_cast<const uint8_t*>(f.values), f.supers, f.shift, first, groups, out);
  } else {
    expand_codes(static_cast<const int8_t*>(f.values), f.supers, f.shift, first, groups, out);
  }
  Factors expanded;
  expanded.values = buffer.data();
  expanded.type = F32;
  return {expanded, 0};
}

template <int64_t L, int C, bool HALVES>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_tile(const Matrix& whole, const Activations& a, int64_t row,
                                                               int64_t r0, float* out, int64_t out_stride) {
  const uint8_t* low = whole.low + row * whole.low_stride();
  const uint8_t* high = L == HIGH2 ? whole.high + row * (whole.inputs / 4) : nullptr;
  const int64_t inputs = a.inputs, blocks = a.blocks, groups = whole.groups;
  const int16_t* xq = a.q + r0 * inputs;
  const float* d = a.d + r0 * blocks;
  __m256 acc[C], odd[C];  // even and odd blocks: two chains of dependent multiply-adds instead of one
#pragma GCC unroll 4
  for (int t = 0; t < C; ++t) acc[t] = odd[t] = _mm256_setzero_ps();
  thread_local std::vector<float> scale_buffer, bias_buffer;
  const RowFactors scales = row_factors(whole.scales, row * groups, groups, scale_buffer);
  const RowFactors biases = row_factors(whole.biases, row * groups, groups, bias_buffer);
  Matrix m = whole;  // this row's factors: read in place, or expanded from codes
  m.scales = scales.factors;
  m.biases = biases.factors;
  const int64_t first = scales.first;
  const int shift = HALVES ? 0 : __builtin_ctzll(m.group / BLOCK);  // log2 of blocks per group
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(low + b * (L == BYTES ? 32 : 16) + PREFETCH_BYTES), _MM_HINT_T0);
    const float s0 = load_factor(m.scales, first + (HALVES ? 2 * b : b >> shift));
    const float s1 = load_factor(m.scales, first + (HALVES ? 2 * (b + 1) : (b + 1) >> shift));
    const float h0 = HALVES ? load_factor(m.scales, first + 2 * b + 1) : s0;
    const float h1 = HALVES ? load_factor(m.scales, first + 2 * b + 3) : s1;
    block_step<L, C, HALVES>(low, high, xq, d, inputs, blocks, b, s0, h0, acc);
    block_step<L, C, HALVES>(low, high, xq, d, inputs, blocks, b + 1, s1, h1, odd);
  }
  if (b < blocks) {
    const float s0 = load_factor(m.scales, first + (HALVES ? 2 * b : b >> shift));
    block_step<L, C, HALVES>(low, high, xq, d, inputs, blocks, b, s0,
                             HALVES ? load_factor(m.scales, first + 2 * b + 1) : s0, acc);
  }
  const float* gsum = a.gsum + r0 * groups;
  float sums[C];
  if (m.biases.values) {
    group_sums<C>(m.biases, groups, biases.first, gsum, groups, whole.biases.type, sums);
  } else {
    group_sums<C>(m.scales, groups, first, gsum, groups, whole.scales.type, sums);
  }
  for (int t = 0; t < C; ++t) {
    float total = hsum(_mm256_add_ps(acc[t], odd[t]));
    total += m.biases.values ? sums[t] : -m.zero * sums[t];
    out[(r0 + t) * out_stride + row] = total;
  }
}

// Block b of R weight rows against one activation row (rows_avx2_across).
template <int64_t L, bool HALVES, int R>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void across_step(
    const uint8_t* const* low, const uint8_t* const* high, const RowFactors* scales, const int16_t* xq,
    const float* d, int64_t b, int shift, __m256* into) {
  constexpr int64_t code_bytes = L == BYTES ? 32 : 16;
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * BLOCK));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * BLOCK + 16));
  const float db = d[b];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const Halves codes = block_codes<L>(low[i] + b * code_bytes, L == HIGH2 ? high[i] + b * 8 : nullptr);
    const __m256i p0 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(codes.lo), x0);
    const __m256i p1 = _mm256_madd_epi16(_mm256_cvtepu8_epi16(codes.hi), x1);
    const Factors& f = scales[i].factors;
    const int64_t first = scales[i].first;
    if constexpr (HALVES) {
      into[i] = _mm256_fmadd_ps(_mm256_set1_ps(load_factor(f, first + 2 * b) * db), _mm256_cvtepi32_ps(p0), into[i]);
      into[i] = _mm256_fmadd_ps(_mm256_set1_ps(load_factor(f, first + 2 * b + 1) * db), _mm256_cvtepi32_ps(p1),
                                into[i]);
    } else {
      into[i] = _mm256_fmadd_ps(_mm256_set1_ps(load_factor(f, first + (b >> shift)) * db),
                                _mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), into[i]);
    }
  }
}

// R weight rows against one activation row (a decode step's product): the activation block is loaded once for
// all R, and each row's sums are the same operations in the same order as rows_avx2_tile's for that row alone
// (even and odd chains, then the biases), so its results are bit for bit the same.
template <int64_t L, bool HALVES, int R>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2_across(const Matrix& whole, const Activations& a,
                                                                 int64_t row, int64_t r0, float* out,
                                                                 int64_t out_stride) {
  const int64_t blocks = a.blocks, groups = whole.groups;
  const int16_t* xq = a.q + r0 * a.inputs;
  const float* d = a.d + r0 * blocks;
  constexpr int64_t code_bytes = L == BYTES ? 32 : 16;
  thread_local std::vector<float> buffers[2 * R];
  const uint8_t* low[R];
  const uint8_t* high[R];
  RowFactors scales[R], biases[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    low[i] = whole.low + (row + i) * whole.low_stride();
    high[i] = L == HIGH2 ? whole.high + (row + i) * (whole.inputs / 4) : nullptr;
    scales[i] = row_factors(whole.scales, (row + i) * groups, groups, buffers[2 * i]);
    biases[i] = row_factors(whole.biases, (row + i) * groups, groups, buffers[2 * i + 1]);
  }
  const int shift = HALVES ? 0 : __builtin_ctzll(whole.group / BLOCK);
  __m256 acc[R], odd[R];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) acc[i] = odd[i] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(low[i] + b * code_bytes + PREFETCH_BYTES), _MM_HINT_T0);
    }
    across_step<L, HALVES, R>(low, high, scales, xq, d, b, shift, acc);
    across_step<L, HALVES, R>(low, high, scales, xq, d, b + 1, shift, odd);
  }
  if (b < blocks) across_step<L, HALVES, R>(low, high, scales, xq, d, b, shift, acc);
  const float* gsum = a.gsum + r0 * groups;
  for (int i = 0; i < R; ++i) {
    float total = hsum(_mm256_add_ps(acc[i], odd[i]));
    total += whole.biases.values
                 ? group_sum(biases[i].factors, groups, biases[i].first, gsum, whole.biases.type)
                 : -whole.zero * group_sum(scales[i].factors, groups, scales[i].first, gsum, whole.scales.type);
    out[r0 * out_stride + row + i] = total;
  }
}

// Weight rows [first, last) against activation rows [r0, r0 + count).
template <int64_t L, bool HALVES>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const Matrix& m, const Activations& a, int64_t first,
                                                          int64_t last, int64_t r0, int64_t count, float* out,
                                                          int64_t out_stride) {
  int64_t row = first;
  if (count == 1) {
    for (; row + 4 <= last; row += 4) rows_avx2_across<L, HALVES, 4>(m, a, row, r0, out, out_stride);
  }
  for (; row < last; ++row) {
    switch (count) {
      case 1: rows_avx2_tile<L, 1, HALVES>(m, a, row, r0, out, out_stride); break;
      case 2: rows_avx2_tile<L, 2, HALVES>(m, a, row, r0, out, out_stride); break;
      case 3: rows_avx2_tile<L, 3, HALVES>(m, a, row, r0, out, out_stride); break;
      default: rows_avx2_tile<L, 4, HALVES>(m, a, row, r0, out, out_stride); break;
    }
  }
}

bool has_avx2() { return exo::native_avx2(); }
#endif


RowKernel pick_kernel(int64_t layout, bool halves) {
#ifdef EXO_X86
  if (native_isa() == Isa::AVX512) return vnni_kernel(layout, halves);
  if (has_avx2()) {
    if (halves) return layout == NIBBLES ? rows_avx2<NIBBLES, true> : rows_avx2<HIGH2, true>;
    if (layout == NIBBLES) return rows_avx2<NIBBLES, false>;
    if (layout == HIGH2) return rows_avx2<HIGH2, false>;
    return rows_avx2<BYTES, false>;
  }
#endif
  return rows_portable;
}

Factors factors(const at::Tensor& values, const at::Tensor& supers, int64_t groups) {
  Factors f;
  if (values.numel() == 0) return f;
  TORCH_CHECK(values.is_contiguous() && supers.is_contiguous(), "packed tensors must be contiguous");
  f.values = values.data_ptr();
  switch (values.scalar_type()) {
    case at::kFloat: f.type = F32; break;
    case at::kHalf: f.type = F16; break;
    case at::kBFloat16: f.type = BF16; break;
    case at::kByte: f.type = U8_CODES; break;
    case at::kChar: f.type = I8_CODES; break;
    default: TORCH_CHECK(false, "scales must be float32/16, bfloat16, or 8-bit codes");
  }
  if (f.type >= U8_CODES) {
    TORCH_CHECK(supers.scalar_type() == at::kFloat && supers.numel() > 0, "8-bit codes need float32 super scales");
    const int64_t per_super = groups / supers.size(1);
    TORCH_CHECK(per_super > 0 && (per_super & (per_super - 1)) == 0 && per_super * supers.size(1) == groups,
                "super-blocks must hold a power of two of groups");
    f.supers = supers.data_ptr<float>();
    f.shift = __builtin_ctzll(per_super);
  }
  return f;
}

Matrix view(const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales, const at::Tensor& biases,
            const at::Tensor& super_scales, const at::Tensor& super_biases, int64_t layout, double zero,
            int64_t group) {
  TORCH_CHECK(low.is_contiguous() && scales.dim() == 2, "packed tensors must be contiguous, scales [out, groups]");
  TORCH_CHECK(group == 16 ? layout != BYTES : (group >= BLOCK && (group & (group - 1)) == 0),
              "groups must be 16 (codes of up to 6 bits) or a power of two from 32");
  Matrix m;
  m.low = low.data_ptr<uint8_t>();
  m.high = layout == HIGH2 ? high.data_ptr<uint8_t>() : nullptr;
  m.groups = scales.size(1);
  m.scales = factors(scales, super_scales, m.groups);
  TORCH_CHECK(m.scales.values != nullptr, "a matrix needs scales");
  m.biases = factors(biases, super_biases, m.groups);
  m.zero = static_cast<float>(zero);
  m.layout = layout;
  m.group = group;
  m.inputs = m.groups * group;
  m.outputs = scales.size(0);
  m.interleaved = native_isa() == Isa::AVX512;  // as matrix.py packed it (row_block)
  return m;
}

// Many rows (a prompt): the weights dequantized to float32, a chunk of outputs at a time, and multiplied by
// a float32 GEMM (oneDNN's, see half.cpp), which at this size outruns the integer kernel (each weight's dequantization is shared
// by all rows).
at::Tensor dequantized_matmul(const at::Tensor& x, const Matrix& m, int64_t outputs) {
  at::Tensor out = at::empty({x.size(0), outputs}, x.options());
  at::Tensor weights = at::empty({std::min(GEMM_CHUNK, outputs), m.inputs}, x.options());
  float* w = weights.data_ptr<float>();
  for (int64_t start = 0; start < outputs; start += GEMM_CHUNK) {
    const int64_t count = std::min(GEMM_CHUNK, outputs - start);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequantize_row(m, start + i, w + i * m.inputs);
    });
    out.narrow(1, start, count).copy_(exo::float_linear(x, weights.narrow(0, 0, count)));
  }
  return out;
}

at::Tensor integer_matmul(const at::Tensor& xc, const Matrix& m, int64_t outputs);

// x [rows, in] float32 times the matrix's transpose -> [rows, out] float32.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales,
                  const at::Tensor& biases, const at::Tensor& super_scales, const at::Tensor& super_biases,
                  int64_t layout, double zero, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "activations must be float32 [rows, in]");
  const Matrix m = view(low, high, scales, biases, super_scales, super_biases, layout, zero, group);
  TORCH_CHECK(x.size(1) == m.inputs && m.inputs % BLOCK == 0, "activations' width does not match the matrix");
  const at::Tensor xc = x.contiguous();
  if (x.size(0) >= GEMM_ROWS) return dequantized_matmul(xc, m, scales.size(0));
  return integer_matmul(xc, m, scales.size(0));
}

// Weight-row blocks [begin, end) of the integer kernel's product (out: [a.rows, outputs]). Chunks of activation
// rows that stay in L2 (~192 KB of codes); in each, the blocks of weight rows pass the chunk's rows four at a time
// (a block's codes and four rows' stay in L1). So the activations are read from memory once and the weights once
// per chunk.
void integer_rows(const Matrix& m, const Activations& a, int64_t outputs, float* o, int64_t begin, int64_t end) {
  const RowKernel kernel = pick_kernel(m.layout, m.group < BLOCK);
  const int64_t chunk = std::max<int64_t>(ROW_TILE, (192 << 10) / (2 * a.inputs) / ROW_TILE * ROW_TILE);
  for (int64_t r0 = 0; r0 < a.rows; r0 += chunk) {
    const int64_t chunk_end = std::min(a.rows, r0 + chunk);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * WEIGHT_BLOCK, last = std::min(outputs, first + WEIGHT_BLOCK);
      for (int64_t r = r0; r < chunk_end; r += ROW_TILE) {
        kernel(m, a, first, last, r, std::min(ROW_TILE, chunk_end - r), o, outputs);
      }
    }
  }
}

int64_t weight_blocks(int64_t outputs) { return (outputs + WEIGHT_BLOCK - 1) / WEIGHT_BLOCK; }

// The integer kernel for any number of rows: each row's outputs computed as they are for that row alone.
at::Tensor integer_matmul(const at::Tensor& xc, const Matrix& m, int64_t outputs) {
  const Activations a = quantize(xc, m.group);
  at::Tensor out = at::empty({a.rows, outputs}, xc.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, weight_blocks(outputs), 1,
                   [&](int64_t begin, int64_t end) { integer_rows(m, a, outputs, o, begin, end); });
  return out;
}

Matrix packed_view(const exo::PackedMatrix& w) {
  return view(w.low, w.high, w.scales, w.biases, w.super_scales, w.super_biases, w.layout, w.zero, w.group);
}

// Rows `ids` of the matrix, dequantized to float32 [n, in]: scale * q + bias, rounded as numpy's
// AffineGroups.dequantize does (a product, then a sum; built with -ffp-contract=off, so never fused).
at::Tensor rows(const at::Tensor& ids, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales,
                const at::Tensor& biases, const at::Tensor& super_scales, const at::Tensor& super_biases,
                int64_t layout, double zero, int64_t group) {
  const Matrix m = view(low, high, scales, biases, super_scales, super_biases, layout, zero, group);
  const at::Tensor idc = ids.contiguous().to(at::kLong);
  const int64_t n = idc.numel(), outputs = scales.size(0);
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < outputs, "row id out of range");
  at::Tensor out = at::empty({n, m.inputs}, low.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dequantize_row(m, id[i], o + i * m.inputs);
  });
  return out;
}

std::string kernel_name() {
  const char* asked = std::getenv("EXO_LIKE_NATIVE_ISA");
  const std::string why = asked != nullptr ? " (EXO_LIKE_NATIVE_ISA)" : "";
  switch (native_isa()) {
    case Isa::AVX512: return "avx512-vnni" + why;
    case Isa::AVX2: return "avx2" + why;
    default: return "portable" + why;
  }
}

// The activations as the integer kernels take them (for tests): (codes int16 [rows, in], block scales float32
// [rows, in / 32], and for the VNNI kernel the codes' hi and lo bytes and each block's lo sum; empty elsewhere).
std::vector<at::Tensor> activation_codes(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % BLOCK == 0, "float32 [rows, in / 32 * 32]");
  const at::Tensor xc = x.contiguous();
  const Activations a = quantize(xc, BLOCK);
  const auto copy = [](const void* data, int64_t rows, int64_t n, at::ScalarType type) {
    if (data == nullptr) return at::empty({0}, at::TensorOptions().dtype(type));
    return at::from_blob(const_cast<void*>(data), {rows, n}, at::TensorOptions().dtype(type)).clone();
  };
  return {copy(a.q, a.rows, a.inputs, at::kShort), copy(a.d, a.rows, a.blocks, at::kFloat),
          copy(a.hi, a.rows, a.inputs, at::kChar), copy(a.lo, a.rows, a.inputs, at::kByte),
          copy(a.lo_sum, a.rows, a.blocks, at::kInt)};
}

// Rows a quantized matrix's storage interleaves (matrix.py packs so): ROW_BLOCK for the VNNI kernel, else 1.
int64_t row_block() { return native_isa() == Isa::AVX512 ? ROW_BLOCK : 1; }

}  // namespace

namespace exo {
// x @ w.T on the integer kernel for any number of rows (batch-invariant: a row's result is the same alone or
// beside others, which the dequantized GEMM that `matmul` switches to for many rows does not keep).
at::Tensor quant_rows_matmul(const at::Tensor& x, const PackedMatrix& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "activations must be float32 [rows, in]");
  const Matrix m = packed_view(w);
  TORCH_CHECK(x.size(1) == m.inputs && m.inputs % BLOCK == 0, "activations' width does not match the matrix");
  return integer_matmul(x.contiguous(), m, w.scales.size(0));
}

std::vector<at::Tensor> quant_rows_matmuls(const std::vector<at::Tensor>& xs, const std::vector<const PackedMatrix*>& ws) {
  TORCH_CHECK(xs.size() == ws.size(), "one activation tensor per matrix");
  const size_t n = ws.size();
  std::vector<at::Tensor> inputs, outs;
  std::vector<Matrix> ms;
  std::vector<Activations> as(n);
  std::vector<Scratch> scratch(n);
  std::vector<int64_t> starts(n + 1, 0);  // job i owns the flattened weight-row blocks [starts[i], starts[i + 1])
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(xs[i].dim() == 2 && xs[i].scalar_type() == at::kFloat, "activations must be float32 [rows, in]");
    ms.push_back(packed_view(*ws[i]));
    TORCH_CHECK(xs[i].size(1) == ms[i].inputs && ms[i].inputs % BLOCK == 0, "activations' width does not match");
    inputs.push_back(xs[i].contiguous());
    as[i] = quantize_into(inputs[i], ms[i].group, scratch[i]);
    outs.push_back(at::empty({as[i].rows, ws[i]->scales.size(0)}, inputs[i].options()));
    starts[i + 1] = starts[i] + weight_blocks(ws[i]->scales.size(0));
  }
  at::parallel_for(0, starts[n], 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < n; ++i) {
      const int64_t lo = std::max(begin, starts[i]), hi = std::min(end, starts[i + 1]);
      if (lo < hi) {
        integer_rows(ms[i], as[i], outs[i].size(1), outs[i].data_ptr<float>(), lo - starts[i], hi - starts[i]);
      }
    }
  });
  return outs;
}

void register_decode(pybind11::module& module);  // decode.cpp
void register_half(pybind11::module& module);    // half.cpp
void register_rows(pybind11::module& module);    // rows.cpp
}  // namespace exo

using KernelArgs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, double,
                              int64_t>;  // NativeMatrix.kernel_args()

std::vector<at::Tensor> rows_matmuls(const std::vector<at::Tensor>& xs, const std::vector<KernelArgs>& matrices) {
  std::vector<exo::PackedMatrix> packed;
  for (const auto& [low, high, scales, biases, super_scales, super_biases, layout, zero, group] : matrices) {
    packed.push_back(exo::PackedMatrix{low, high, scales, biases, super_scales, super_biases, layout, group, zero});
  }
  std::vector<const exo::PackedMatrix*> pointers;
  for (const auto& p : packed) pointers.push_back(&p);
  return exo::quant_rows_matmuls(xs, pointers);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  exo::register_decode(module);
  exo::register_half(module);
  exo::register_rows(module);
  module.def("matmul", &matmul, "x @ w.T for a packed affine-groups matrix (int16 activation blocks)");
  module.def("rows_matmuls", &rows_matmuls, "xs[i] @ w[i].T for each i on the integer kernel, in one parallel region");
  module.def("rows", &rows, "rows of a packed affine-groups matrix, dequantized");
  module.def("kernel_name", &kernel_name, "which kernel this CPU runs");
  module.def("activation_codes", &activation_codes, "the activations as the integer kernels quantize them");
  module.def("row_block", &row_block, "rows a quantized matrix's storage interleaves (1: row-major)");
}
