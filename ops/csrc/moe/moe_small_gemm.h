// Single-threaded fp32 GEMMs for an expert's few rows against its weight (moe_small_gemm_cpu.cpp).
// All operands are row-major and contiguous; the callers pick them for small row counts only.
#pragma once

#include <cstdint>

namespace ze {
namespace moe {
namespace small_gemm {

// Rows per expert up to which these beat ATen's GEMM (measured: see moe_small_gemm_cpu.cpp).
constexpr int64_t kMaxRows = 256;

// Whether the kernels were compiled (AVX2 + FMA); without them the functions below do nothing.
bool available();

// available() and not turned off by ZEROENGINE_MOE_SMALL_GEMM=0 (for comparisons and as an escape hatch):
// whether callers route their GEMMs here.
bool enabled();

// c[m][n] = sum_k a[m][k] w[n][k] (+ bias[n]):  a [m, k], w [n, k], c [m, n]; with out_transposed c is
// [n, m] instead (c[n][m] = the same sum; no bias then: pass nullptr).
void nt(const float* a, const float* w, const float* bias, float* c, int64_t m, int64_t n, int64_t k,
        bool out_transposed = false);

// c[m][k] = sum_n a[m][n] w[n][k] (added to c's values with accumulate):  a [m, n], w [n, k], c [m, k].
void nn(const float* a, const float* w, float* c, int64_t m, int64_t n, int64_t k, bool accumulate = false);

// c[n][k] = sum_m a[m][n] b[m][k]:  a [m, n], b [m, k], c [n, k].
void tn(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k);

}  // namespace small_gemm
}  // namespace moe
}  // namespace ze
