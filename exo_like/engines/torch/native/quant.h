// What the kernel files share of the quantized product (quant.cpp; vnni.cpp runs it with AVX-512 VNNI): a packed
// matrix's tensors (matrix.py's NativeMatrix.kernel_args), the views the kernels read them through, the quantized
// activations, and the products decode.cpp calls.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace exo {

struct PackedMatrix {
  at::Tensor low, high, scales, biases, super_scales, super_biases;
  int64_t layout = 0, group = 0;
  double zero = 0.0;
};

// x [rows, in] @ w.T on the integer kernel for any number of rows (batch-invariant).
at::Tensor quant_rows_matmul(const at::Tensor& x, const PackedMatrix& w);

// xs[i] @ ws[i].T for every i in one parallel region (a token's experts: one region instead of one per expert,
// each product's results the same as quant_rows_matmul's).
std::vector<at::Tensor> quant_rows_matmuls(const std::vector<at::Tensor>& xs,
                                           const std::vector<const PackedMatrix*>& ws);

// Which code the native kernels run, chosen once per process (quant.cpp): AVX-512 with VNNI where the CPU has it,
// else AVX2 + FMA + F16C, else portable C++; EXO_LIKE_NATIVE_ISA=avx2 or =portable asks for a lower one (to run
// that path on any machine).
enum class Isa { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };
Isa native_isa();
bool native_avx2();    // AVX2 code or better: the AVX2 helpers of every kernel file
bool native_avx512();  // AVX-512 code (rows.cpp's float tiles, vnni.cpp)

constexpr int64_t BLOCK = 32;       // inputs per activation block (and per block of packed codes)
// Where the kernels run AVX-512 code, a quantized matrix's rows are stored interleaved in blocks of this many
// (matrix.py's interleave): one 512-bit register then holds a piece of each of 16 rows, one lane a row.
constexpr int64_t ROW_BLOCK = 16;
constexpr int64_t PREFETCH_BYTES = 4096;  // how far ahead of its reads a row's codes are asked for (see rows.cpp)

enum Layout : int64_t { NIBBLES = 0, HIGH2 = 1, BYTES = 2 };
enum ScaleType : int { F32 = 0, F16 = 1, BF16 = 2, U8_CODES = 3, I8_CODES = 4 };

// The activations quantized: int16 codes and a scale per block of 32, and per group the float32 sum of the values
// (for the biases). For the VNNI kernel also each code split in bytes, q = 256 * hi + lo (hi signed, lo unsigned),
// and per block the sum of its lo bytes. Pointers into scratch, valid until the owner's next product.
struct Activations {
  const int16_t* q;
  const float *d, *gsum;
  const int8_t* hi = nullptr;
  const uint8_t* lo = nullptr;
  const int32_t* lo_sum = nullptr;  // [rows, blocks]
  int64_t rows, inputs, blocks, groups;
};

inline float half_to_float(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline float bfloat_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// A run of per-group factors: 16/32-bit floats, or 8-bit codes times a float32 per `1 << shift` groups.
struct Factors {
  const void* values = nullptr;  // [out, groups]; null: none
  const float* supers = nullptr; // [out, groups >> shift] for codes
  int type = F32;
  int shift = 0;

  // Factor `i` of `values`, `s` the index of its super-block's float32 in `supers` (codes only).
  float at(int64_t i, int64_t s) const {
    switch (type) {
      case F16: return half_to_float(static_cast<const uint16_t*>(values)[i]);
      case BF16: return bfloat_to_float(static_cast<const uint16_t*>(values)[i]);
      case U8_CODES: return static_cast<float>(static_cast<const uint8_t*>(values)[i]) * supers[s];
      case I8_CODES: return static_cast<float>(static_cast<const int8_t*>(values)[i]) * supers[s];
      default: return static_cast<const float*>(values)[i];
    }
  }
  float at(int64_t i) const { return at(i, i >> shift); }  // row-major storage
};

// One matrix in its packed form: row-major, or (interleaved) rows in blocks of ROW_BLOCK where each per-row unit
// (4 code bytes, one factor) of the block's rows lies side by side: unit j of row r at
// (r - i) * n + j * width + i, with i = r % ROW_BLOCK, n units a row and `width` rows in r's block (ROW_BLOCK, or
// fewer in the last).
struct Matrix {
  const uint8_t* low;    // NIBBLES/HIGH2: [out, in / 2]; BYTES: [out, in]
  const uint8_t* high;   // HIGH2: [out, in / 4]
  Factors scales, biases;  // biases.values null: bias = -zero * scale
  float zero;
  int64_t layout, group, inputs, groups, outputs;
  bool interleaved = false;

  // Index of unit j of `row`, rows of n units each.
  int64_t unit(int64_t row, int64_t j, int64_t n) const {
    if (!interleaved) return row * n + j;
    const int64_t first = row - row % ROW_BLOCK;
    const int64_t width = std::min<int64_t>(ROW_BLOCK, outputs - first);
    return first * n + j * width + (row - first);
  }
  float factor(const Factors& f, int64_t row, int64_t g) const {
    return f.at(unit(row, g, groups), f.supers ? unit(row, g >> f.shift, groups >> f.shift) : 0);
  }
  float scale(int64_t row, int64_t g) const { return factor(scales, row, g); }
  float bias(int64_t row, int64_t g) const { return biases.values ? factor(biases, row, g) : -zero * scale(row, g); }
  int64_t low_stride() const { return layout == BYTES ? inputs : inputs / 2; }
};

// Weight rows [first, last) against activation rows [r0, r0 + count) into out[r * out_stride + row].
using RowKernel = void (*)(const Matrix&, const Activations&, int64_t first, int64_t last, int64_t r0, int64_t count,
                           float* out, int64_t out_stride);

// vnni.cpp: the AVX-512 VNNI kernel for interleaved matrices (first a multiple of ROW_BLOCK, last - first at most
// ROW_BLOCK, count at most 4).
RowKernel vnni_kernel(int64_t layout, bool halves);

}  // namespace exo
