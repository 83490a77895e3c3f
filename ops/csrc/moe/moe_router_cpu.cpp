// The router's two GEMMs on CPU, fp32, through the small-row kernels (moe_small_gemm_cpu.cpp):
//
//   logits [S, E] = x [S, D] @ wg [E, D]^T            (forward)
//   grad_wg [E, D] = grad_logits [S, E]^T @ x [S, D]    (backward, the router weight's gradient)
//
// Why not ATen's GEMMs: with few experts (E = 8-64 columns) and many tokens both products are
// skinny. Measured on a 2-core AVX2 host at 4096 x 512 (ms, median): logits 0.46-0.51 against
// MKL's 0.74-0.80 at E = 8 and level with it at 64; weight gradient 0.70 against 0.89 at 8,
// 2.1 against 2.3-2.6 at 64. With the router's input gradient these GEMMs are about 40% of a
// 64-expert layer's time when its experts cost nothing (bench_moe.py's overhead rows). The
// tokens are split across threads; the weight gradient sums one [E, D] partial per thread
// (small: 128 KiB at 64 x 512). The logits use nt with the router weight as the packed operand
// (packed once per 256 tokens) and the tokens' rows streamed through once.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "moe_cpu.h"
#include "moe_small_gemm.h"

namespace ze {
namespace moe {
namespace {

constexpr int64_t kTokenBlock = 256;  // tokens per forward block (the router weight is packed once per block)
constexpr int64_t kParallelFlops = 1 << 20;  // below this, one thread is faster than waking the team

void check_fp32_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous(),
              "moe_dispatch.router: ", what, " must be a contiguous 2-d float32 CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
}

}  // namespace

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& wg) {
  TORCH_CHECK(small_gemm::available(), "moe_dispatch.router_logits needs the AVX2 small-row GEMMs");
  check_fp32_2d(x, "x");
  check_fp32_2d(wg, "wg");
  TORCH_CHECK(x.size(1) == wg.size(1), "moe_dispatch.router_logits: x is ", x.sizes(), " but wg is ", wg.sizes());
  const int64_t tokens = x.size(0), experts = wg.size(0), dim = x.size(1);
  if (dim == 0) return at::zeros({tokens, experts}, x.options());
  at::Tensor out = at::empty({tokens, experts}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = wg.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * experts * dim > kParallelFlops)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t0 = b * kTokenBlock, rows = std::min(kTokenBlock, tokens - t0);
    small_gemm::nt(wp, xp + t0 * dim, nullptr, op + t0 * experts, experts, rows, dim, /*out_transposed=*/true);
  }
  return out;
}

at::Tensor router_weight_grad(const at::Tensor& grad_logits, const at::Tensor& x) {
  TORCH_CHECK(small_gemm::available(), "moe_dispatch.router_weight_grad needs the AVX2 small-row GEMMs");
  check_fp32_2d(grad_logits, "grad_logits");
  check_fp32_2d(x, "x");
  TORCH_CHECK(grad_logits.size(0) == x.size(0), "moe_dispatch.router_weight_grad: grad_logits is ",
              grad_logits.sizes(), " but x is ", x.sizes());
  const int64_t tokens = x.size(0), experts = grad_logits.size(1), dim = x.size(1);
  if (tokens == 0 || experts == 0 || dim == 0) return at::zeros({experts, dim}, x.options());
  const int threads = tokens * experts * dim > kParallelFlops ? std::max(1, at::get_num_threads()) : 1;
  const int64_t parts = std::min<int64_t>(threads, tokens);
  at::Tensor out = at::empty({experts, dim}, x.options());
  // part 0 writes the result; the others their own partial sums, added after
  std::vector<float> partials(static_cast<size_t>((parts - 1) * experts * dim));
  const float* gp = grad_logits.const_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
#pragma omp parallel for schedule(static, 1) num_threads(parts) if (parts > 1)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t t0 = tokens * p / parts, t1 = tokens * (p + 1) / parts;
    float* c = p == 0 ? op : partials.data() + (p - 1) * experts * dim;
    small_gemm::tn(gp + t0 * experts, xp + t0 * dim, c, t1 - t0, experts, dim);
  }
  const int64_t size = experts * dim;
  for (int64_t p = 1; p < parts; ++p) {
    const float* c = partials.data() + (p - 1) * size;
    for (int64_t i = 0; i < size; ++i) op[i] += c[i];
  }
  return out;
}

}  // namespace moe
}  // namespace ze
