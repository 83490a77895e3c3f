// The CPU MoE kernels beyond token permutation, registered by moe_dispatch_cpu.cpp's module.
//
// moe_grouped_cpu.cpp: per-expert GEMMs over expert-contiguous rows (exact sizes, no padding),
//   all experts in one OpenMP region (each GEMM single-threaded inside it).
// moe_gate_cpu.cpp: the top-k router after the logits GEMM, forward and backward in one pass
//   each (softmax, top-k, capacity positions, counts, dispatch index maps, aux-loss terms).
// moe_router_cpu.cpp: the router's logits GEMM and its weight gradient (fp32, small-row kernels).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace ze {
namespace moe {

// out[rows of e] = a[rows of e] @ (trans_w ? w[e]^T : w[e]) (+ bias[e]); rows of e: counts[e] consecutive rows.
void grouped_rows_mm(const at::Tensor& a, const std::vector<at::Tensor>& w, const std::vector<int64_t>& counts,
                     const std::vector<at::Tensor>& bias, bool trans_w, at::Tensor out);

// out[e] = a[rows of e]^T @ b[rows of e]; bias_out[e] = column sums of a[rows of e] (if given).
// Experts with no rows get zeros.
void grouped_weight_grad(const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& counts,
                         at::Tensor out, const std::optional<at::Tensor>& bias_out);

// See moe_gate_cpu.cpp and zeroengine/moe/fused_gate.py.
std::vector<at::Tensor> topk_gate_forward(const at::Tensor& logits, const std::optional<at::Tensor>& select,
                                          int64_t k, int64_t capacity, bool renormalize);

at::Tensor topk_gate_backward(const at::Tensor& probs, const at::Tensor& expert_index, const at::Tensor& chosen,
                              const at::Tensor& kept, const at::Tensor& grad_weights, const at::Tensor& aux_coef,
                              bool renormalize);

// x [S, D] @ wg [E, D]^T and grad_logits [S, E]^T @ x [S, D]; need small_gemm::available().
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& wg);
at::Tensor router_weight_grad(const at::Tensor& grad_logits, const at::Tensor& x);

}  // namespace moe
}  // namespace ze
