// What decode.cpp calls in quant.cpp: a packed quantized matrix's tensors (matrix.py's NativeMatrix.kernel_args),
// and products of one or several such matrices on the integer kernel.
#pragma once

#include <torch/extension.h>

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

}  // namespace exo
