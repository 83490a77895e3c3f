// Interface between the CUDA token permutation kernels (moe_dispatch.cu) and
// their torch binding (moe_dispatch_cuda.cpp). Raw pointers only: the .cu file
// includes no torch header, so plain nvcc compiles it on any machine.
//
// The three operations (the CPU kernels in moe_dispatch_cpu.cpp compute the same):
//   gather:   out[i, :] = x[index[i], :]                        (token permutation)
//   combine:  out[t, :] = sum_j w[t, j] * y[rows[t, j], :]       (un-permutation + weighted combine)
//   combine backward, for every (t, j) with rows[t, j] >= 0:
//             grad_y[rows[t, j], :] = w[t, j] * g[t, :]
//             grad_w[t, j]          = <g[t, :], y[rows[t, j], :]>
// rows[t, j] < 0 marks a dropped assignment; w == nullptr means unit weights.
// Arithmetic is fp32 whatever the storage type.
#pragma once

#include <cstdint>

namespace ze {
namespace moe {

enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Each returns nullptr on success, else the CUDA error string; `stream` is a cudaStream_t.
const char* gather_rows_cuda(const void* x, const int64_t* index, void* out, int64_t n_out, int64_t n_in,
                             int64_t dim, DType type, void* stream);

const char* combine_rows_cuda(const void* y, const int64_t* rows, const float* w, void* out, int64_t tokens,
                              int64_t k, int64_t n_rows, int64_t dim, DType type, void* stream);

const char* combine_rows_backward_cuda(const void* g, const void* y, const int64_t* rows, const float* w,
                                       void* grad_y, float* grad_w, int64_t tokens, int64_t k, int64_t n_rows,
                                       int64_t dim, DType type, void* stream);

}  // namespace moe
}  // namespace ze
