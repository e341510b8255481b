// Products with matrices held as 16-bit floats (bfloat16 or float16, as a checkpoint stores them, or a quantized
// type no kernel takes, dequantized) and float32 activations: each weight is widened to float32 exactly as it is
// loaded, so the product is the float32 one of the stored values, with no rounding of the activations. CPUs
// without bfloat16 arithmetic (AVX2, AVX-512 without BF16) run bfloat16 products this way at memory speed, where
// oneDNN's bfloat16 GEMM emulates the type and prefills a prompt at a sixth of float32's rate.
//
// Few rows (decoding): each output a dot product streaming its weight row once, widened in registers. Many rows (a
// prompt): a chunk of outputs widened into a float32 buffer, then torch's float32 GEMM (each widening shared by
// all rows). ISA: AVX2 + FMA + F16C chosen at run time, portable C++ otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EXO_X86 1
#endif

namespace exo {
bool native_avx2();  // quant.cpp: AVX2 code, or the portable code
}  // namespace exo

namespace {

constexpr int64_t GEMM_ROWS = 32;            // from this many rows, widened chunks and a float32 GEMM (as quant.cpp)
constexpr int64_t CHUNK_BYTES = 4 << 20;     // float32 weights widened at a time: measured against 64 KB to 16 MB
                                             // chunks over 32 to 512 rows, smaller ones lose to the GEMM's set-up

float widen_portable(uint16_t v, bool bf16) {
  if (!bf16) return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

float dot_portable(const float* x, const uint16_t* w, int64_t n, bool bf16) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) total += x[i] * widen_portable(w[i], bf16);
  return total;
}

#ifdef EXO_X86
bool avx2() { return exo::native_avx2(); }  // quant.cpp

__attribute__((target("avx2,fma,f16c"))) inline __m256 widen8(const uint16_t* w, bool bf16) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  return _mm256_cvtph_ps(raw);
}

__attribute__((target("avx2,fma,f16c"))) float dot_avx2(const float* x, const uint16_t* w, int64_t n, bool bf16) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen8(w + i, bf16), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), widen8(w + i + 8, bf16), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), widen8(w + i + 16, bf16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), widen8(w + i + 24, bf16), s3);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), widen8(w + i, bf16), s0);
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float total = _mm_cvtss_f32(h);
  for (; i < n; ++i) total += x[i] * widen_portable(w[i], bf16);
  return total;
}

__attribute__((target("avx2,fma,f16c"))) void widen_avx2(const uint16_t* w, float* out, int64_t n, bool bf16) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, widen8(w + i, bf16));
  for (; i < n; ++i) out[i] = widen_portable(w[i], bf16);
}
#endif

float dot(const float* x, const uint16_t* w, int64_t n, bool bf16) {
#ifdef EXO_X86
  if (avx2()) return dot_avx2(x, w, n, bf16);
#endif
  return dot_portable(x, w, n, bf16);
}

void widen(const uint16_t* w, float* out, int64_t n, bool bf16) {
#ifdef EXO_X86
  if (avx2()) return widen_avx2(w, out, n, bf16);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = widen_portable(w[i], bf16);
}

using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                 c10::string_view, c10::List<std::optional<at::Scalar>>,
                                 std::optional<c10::string_view>);

// oneDNN's float32 linear on a plain weight, the op PyTorch's compiler calls (and linear.py's Linear): at a
// prompt's row counts 1.5x torch's GEMM here; None where this build lacks it.
std::optional<c10::TypedOperatorHandle<OneDnnLinear>> onednn_linear() {
  static const std::optional<c10::TypedOperatorHandle<OneDnnLinear>> op =
      []() -> std::optional<c10::TypedOperatorHandle<OneDnnLinear>> {
    try {
      if (!at::hasMKLDNN()) return std::nullopt;
      const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
      if (!handle.has_value()) return std::nullopt;
      return handle->typed<OneDnnLinear>();
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }();
  return op;
}

}  // namespace

namespace exo {

// x [rows, in] @ w [out, in].T in float32: oneDNN's linear where present, else torch's.
at::Tensor float_linear(const at::Tensor& x, const at::Tensor& w) {
  const auto op = onednn_linear();
  if (op.has_value()) return op->call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  return at::linear(x, w);
}

// x [rows, in] float32 times w [out, in] (bfloat16 or float16) transposed -> [rows, out] float32.
at::Tensor half_matmul(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "activations must be float32 [rows, in]");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) &&
                  w.is_contiguous() && w.layout() == at::kStrided,
              "the matrix must be a contiguous bfloat16 or float16 [out, in]");
  TORCH_CHECK(x.size(1) == w.size(1), "activations' width does not match the matrix");
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), inputs = w.size(1), outputs = w.size(0);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const uint16_t* weights = reinterpret_cast<const uint16_t*>(w.data_ptr());
  at::Tensor out = at::empty({rows, outputs}, xc.options());
  if (rows >= GEMM_ROWS) {
    const int64_t step = std::max<int64_t>(16, CHUNK_BYTES / (4 * inputs) / 16 * 16);
    at::Tensor chunk = at::empty({std::min(step, outputs), inputs}, xc.options());
    float* c = chunk.data_ptr<float>();
    for (int64_t start = 0; start < outputs; start += step) {
      const int64_t count = std::min(step, outputs - start);
      at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
        widen(weights + (start + begin) * inputs, c + begin * inputs, (end - begin) * inputs, bf16);
      });
      out.narrow(1, start, count).copy_(float_linear(xc, chunk.narrow(0, 0, count)));
    }
    return out;
  }
  const float* xs = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, outputs, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t r = 0; r < rows; ++r) o[r * outputs + n] = dot(xs + r * inputs, weights + n * inputs, inputs, bf16);
    }
  });
  return out;
}

void register_half(pybind11::module& module) {
  module.def("half_matmul", &half_matmul, "x @ w.T for a bfloat16 or float16 matrix, float32 activations and sums");
}

}  // namespace exo
