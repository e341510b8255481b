// Batch-invariant products with plain matrices (float32, or bfloat16 / float16 widened exactly as they are read)
// and float32 activations: every output is computed by the same arithmetic whatever the number of rows, so a
// position's result is bit-identical alone, in a decode step beside other requests, or in a prompt chunk of any
// length (vLLM's batch-invariant mode asks the same of its GPU kernels; a GEMM library picks its blocking, and so
// its summation order, by the problem's shape).
//
// The arithmetic of an output (AVX2 + FMA): eight float32 lanes, lane l summing x[k] * w[k] for k = l mod 8 in
// increasing k with fused multiply-adds, then the lanes added in one fixed tree, then the inputs past the last
// multiple of 8 added one by one. The row and output tiles (below) only choose which outputs are computed side by
// side, never how one is summed. Without AVX2: each output a plain sum in increasing k.
//
// Tiles: 4 rows x 3 outputs (twelve accumulators, three weight vectors and one activation vector: the 16 vector
// registers), weights streamed once per chunk of rows. One row (decoding) streams each weight once, one output at a
// time.
//
// With AVX-512 (where quant.cpp's native_isa picks it) the same scheme sixteen lanes wide, lane l summing k = l mod 16,
// the lanes added by one fixed tree; tiles of 4 rows x 4 outputs. A process runs one of the two throughout.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXO_X86 1
#endif

namespace exo {
bool native_avx2();    // quant.cpp: AVX2 code, or the portable code
bool native_avx512();  // quant.cpp: AVX-512 code
}  // namespace exo

namespace {

constexpr int64_t ROW_TILE = 4;
constexpr int64_t OUT_TILE = 3;
// How far ahead of its reads a single row's product asks for 16-bit weights: a 56 MB bfloat16 matrix streamed at
// 17.8 GB/s without, 21.3 with 2 KB, 25.8 with 4 KB (2 threads here); SmolLM2's BF16 decode step 15-16.5 ->
// 12.8-13.5 ms. float32 weights stream as fast without (the steps measured no better with).
constexpr int64_t PREFETCH_BYTES = 4096;
// Rows whose activations stay in cache while a thread walks its outputs (about 192 KB of them, at least one tile):
// each chunk of rows streams the thread's weights once more.
constexpr int64_t CHUNK_BYTES = 192 << 10;
int64_t row_chunk(int64_t inputs) {
  return std::max<int64_t>(ROW_TILE, CHUNK_BYTES / (4 * inputs) / ROW_TILE * ROW_TILE);
}
enum WeightType : int { F32 = 0, BF16 = 1, F16 = 2 };

inline float widen(const void* w, int64_t i, int type) {
  if (type == F32) return static_cast<const float*>(w)[i];
  const uint16_t v = static_cast<const uint16_t*>(w)[i];
  if (type == F16) return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// The portable arithmetic: one sum per output in increasing k.
void tile_portable(const float* x, const void* w, int type, int64_t inputs, int64_t outputs, int64_t r0,
                   int64_t rows, int64_t n0, int64_t count, float* out) {
  for (int64_t r = r0; r < r0 + rows; ++r) {
    for (int64_t n = n0; n < n0 + count; ++n) {
      float total = 0.0f;
      for (int64_t k = 0; k < inputs; ++k) total += x[r * inputs + k] * widen(w, n * inputs + k, type);
      out[r * outputs + n] = total;
    }
  }
}

#ifdef EXO_X86
bool has_avx2() { return exo::native_avx2(); }  // quant.cpp

template <int T>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const void* w, int64_t i) {
  if constexpr (T == F32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (T == F16) return _mm256_cvtph_ps(raw);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r0 + R) times outputs [n0, n0 + C).
template <int T, int R, int C>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const float* x, const void* w, int64_t inputs,
                                                         int64_t outputs, int64_t r0, int64_t n0, float* out) {
  __m256 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  const int64_t full = inputs / 8 * 8;
  constexpr int64_t line = 64 / (T == F32 ? 4 : 2);  // weights a cache line holds
  for (int64_t start = 0; start < full; start += line) {
    if constexpr (R == 1 && T != F32) {  // one row (decoding) streams 16-bit weights: ask for them ahead
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c) {
        _mm_prefetch(static_cast<const char*>(w) + ((n0 + c) * inputs + start) * (T == F32 ? 4 : 2) + PREFETCH_BYTES,
                     _MM_HINT_T0);
      }
    }
    const int64_t stop = std::min(full, start + line);
    for (int64_t k = start; k < stop; k += 8) {
      __m256 wv[C];
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c) wv[c] = load8<T>(w, (n0 + c) * inputs + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + (r0 + r) * inputs + k);
#pragma GCC unroll 3
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float total = lanes_sum(acc[r][c]);
      for (int64_t k = full; k < inputs; ++k) total += x[(r0 + r) * inputs + k] * widen(w, (n0 + c) * inputs + k, T);
      out[(r0 + r) * outputs + n0 + c] = total;
    }
  }
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

template <int T>
AVX512 inline __m512 load16(const void* w, int64_t i) {
  if constexpr (T == F32) {
    return _mm512_loadu_ps(static_cast<const float*>(w) + i);
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    if constexpr (T == F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

AVX512 inline float lanes_sum16(__m512 v) {
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r0 + R) times outputs [n0, n0 + C), sixteen lanes.
template <int T, int R, int C>
AVX512 void tile_avx512(const float* x, const void* w, int64_t inputs, int64_t outputs, int64_t r0, int64_t n0,
                        float* out) {
  __m512 acc[R][C];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  const int64_t full = inputs / 16 * 16;
  for (int64_t k = 0; k < full; k += 16) {
    if constexpr (R == 1 && T != F32) {  // one row (decoding) streams 16-bit weights: ask for them ahead
      if (k % 32 == 0) {
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          _mm_prefetch(static_cast<const char*>(w) + ((n0 + c) * inputs + k) * 2 + PREFETCH_BYTES, _MM_HINT_T0);
        }
      }
    }
    __m512 wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) wv[c] = load16<T>(w, (n0 + c) * inputs + k);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + (r0 + r) * inputs + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float total = lanes_sum16(acc[r][c]);
      for (int64_t k = full; k < inputs; ++k) total += x[(r0 + r) * inputs + k] * widen(w, (n0 + c) * inputs + k, T);
      out[(r0 + r) * outputs + n0 + c] = total;
    }
  }
}

// One tile of C outputs on the process's code: sixteen lanes (WIDE) or eight (at most OUT_TILE outputs a tile there).
template <int T, int R, int C, bool WIDE>
void tile(const float* x, const void* w, int64_t inputs, int64_t outputs, int64_t r0, int64_t n0, float* out) {
  if constexpr (WIDE) {
    tile_avx512<T, R, C>(x, w, inputs, outputs, r0, n0, out);
  } else {
    tile_avx2<T, R, (C < OUT_TILE ? C : OUT_TILE)>(x, w, inputs, outputs, r0, n0, out);
  }
}

template <int T, int R, bool WIDE>
void tile_rows(const float* x, const void* w, int64_t inputs, int64_t outputs, int64_t r0, int64_t n0, int64_t count,
               float* out) {
  switch (count) {
    case 1: return tile<T, R, 1, WIDE>(x, w, inputs, outputs, r0, n0, out);
    case 2: return tile<T, R, 2, WIDE>(x, w, inputs, outputs, r0, n0, out);
    case 3: return tile<T, R, 3, WIDE>(x, w, inputs, outputs, r0, n0, out);
    default: return tile<T, R, 4, WIDE>(x, w, inputs, outputs, r0, n0, out);
  }
}

template <int T, bool WIDE>
void tile_any(const float* x, const void* w, int64_t inputs, int64_t outputs, int64_t r0, int64_t rows, int64_t n0,
              int64_t count, float* out) {
  switch (rows) {
    case 1: return tile_rows<T, 1, WIDE>(x, w, inputs, outputs, r0, n0, count, out);
    case 2: return tile_rows<T, 2, WIDE>(x, w, inputs, outputs, r0, n0, count, out);
    case 3: return tile_rows<T, 3, WIDE>(x, w, inputs, outputs, r0, n0, count, out);
    default: return tile_rows<T, 4, WIDE>(x, w, inputs, outputs, r0, n0, count, out);
  }
}
#endif

using Tile = void (*)(const float*, const void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*);

Tile pick_tile(int type) {
#ifdef EXO_X86
  if (exo::native_avx512()) {
    return type == F32 ? tile_any<F32, true> : type == BF16 ? tile_any<BF16, true> : tile_any<F16, true>;
  }
  if (has_avx2()) {
    return type == F32 ? tile_any<F32, false> : type == BF16 ? tile_any<BF16, false> : tile_any<F16, false>;
  }
#endif
  return nullptr;
}

}  // namespace

namespace exo {

// x [rows, in] float32 times w [out, in] (float32, bfloat16 or float16) transposed -> [rows, out] float32, each
// output summed the same way for any number of rows.
at::Tensor rows_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "activations must be float32 [rows, in]");
  const auto dtype = w.scalar_type();
  TORCH_CHECK(w.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf) &&
                  w.is_contiguous() && w.layout() == at::kStrided,
              "the matrix must be a contiguous float32, bfloat16 or float16 [out, in]");
  TORCH_CHECK(x.size(1) == w.size(1), "activations' width does not match the matrix");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), inputs = w.size(1), outputs = w.size(0);
  const int type = dtype == at::kFloat ? F32 : dtype == at::kBFloat16 ? BF16 : F16;
  at::Tensor out = at::empty({rows, outputs}, xc.options());
  const float* xs = xc.data_ptr<float>();
  const void* weights = w.data_ptr();
  float* o = out.data_ptr<float>();
  const Tile tile = pick_tile(type);
  // Outputs a tile computes side by side. One row (decoding) takes one output at a time: each thread then reads its
  // share of the matrix as one sequential stream, which the hardware prefetcher follows (four rows' streams at once
  // read 17-20 GB/s on a Zen 4 host where one reads 25-27; SmolLM2 F32 decode 0.61 -> 0.81-0.86 of llama.cpp).
  const int64_t out_tile = rows == 1 ? 1 : exo::native_avx512() ? 4 : OUT_TILE;
  const int64_t tiles = (outputs + out_tile - 1) / out_tile, chunk = row_chunk(inputs);
  at::parallel_for(0, tiles, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t chunk_end = std::min(rows, r0 + chunk);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * out_tile, count = std::min(out_tile, outputs - n0);
        for (int64_t r = r0; r < chunk_end; r += ROW_TILE) {
          const int64_t n_rows = std::min(ROW_TILE, chunk_end - r);
          if (tile != nullptr) {
            tile(xs, weights, inputs, outputs, r, n_rows, n0, count, o);
          } else {
            tile_portable(xs, weights, type, inputs, outputs, r, n_rows, n0, count, o);
          }
        }
      }
    }
  });
  return out;
}

void register_rows(pybind11::module& module) {
  module.def("rows_matmul", &rows_matmul,
             "x @ w.T for a float32, bfloat16 or float16 matrix, each output summed the same way for any rows");
}

}  // namespace exo
