// The top-k router after its logits GEMM, on CPU: forward and backward in one parallel pass each.
//
// The PyTorch version of this step is ~20 small ops (top-k, gather, bincount, a stable argsort for
// capacity positions, scatters for the dispatch maps, renormalisation, the aux loss) and ~10 more
// in backward; each is a pass over [tokens, experts] and, on a shared 2-core machine, a parallel
// region that may wait a time slice for a descheduled thread. Here:
//   forward  pass 1 (tokens in chunks): top-k of `select`, chosen probabilities, per-chunk counts
//                                       per (choice, expert) and per-chunk probability sums;
//            serial                   : counts, capacity, row offsets per (choice, chunk, expert);
//            pass 2 (same chunks)     : positions, kept flags, combine weights, dispatch maps.
//   backward one pass                 : d loss / d logits from the weights' and the aux loss's
//                                       gradients through the softmax.
// Positions are choice-major (every first choice in token order, then every second choice), so
// results do not depend on the chunking or the thread count. zeroengine/moe/fused_gate.py holds
// the definition in PyTorch and documents every output.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "moe_cpu.h"

namespace ze {
namespace moe {
namespace {

constexpr float kEps = std::numeric_limits<float>::epsilon();

void check_f32(const at::Tensor& t, const char* what, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == rows && t.size(1) == cols,
              "moe topk gate: ", what, " must be a contiguous float32 CPU tensor of shape [", rows, ", ", cols, "]");
}

// The k largest entries of row[0..e) (ties: lower index first), written best first.
inline void topk_row(const float* row, int64_t e, int64_t k, int64_t* idx) {
  float best[8];
  for (int64_t j = 0; j < k; ++j) {
    best[j] = -std::numeric_limits<float>::infinity();
    idx[j] = -1;
  }
  for (int64_t i = 0; i < e; ++i) {
    const float v = row[i];
    if (idx[k - 1] >= 0 && !(v > best[k - 1])) continue;
    int64_t j = k - 1;
    while (j > 0 && (idx[j - 1] < 0 || v > best[j - 1])) {
      best[j] = best[j - 1];
      idx[j] = idx[j - 1];
      --j;
    }
    best[j] = v;
    idx[j] = i;
  }
}

}  // namespace

// Returns {expert_index [S,k] i64, chosen [S,k] f32, kept [S,k] bool, weights [S,k] f32,
//          exp_counts [E] i64, kept_counts [E] i64, first_counts [E] i64, prob_sum [E] f32,
//          rows [S,k] i64, index [kept] i64, order [S*k] i64}.
// capacity < 0: dropless. renormalize: weights = chosen*kept / max(sum_j chosen*kept, eps).
std::vector<at::Tensor> topk_gate_forward(const at::Tensor& probs, const std::optional<at::Tensor>& select,
                                          int64_t k, int64_t capacity, bool renormalize) {
  TORCH_CHECK(probs.dim() == 2, "moe topk gate: probs must be [tokens, experts]");
  const int64_t S = probs.size(0), E = probs.size(1);
  check_f32(probs, "probs", S, E);
  TORCH_CHECK(k >= 1 && k <= E && k <= 8, "moe topk gate: k must be in [1, min(experts, 8)]");
  const at::Tensor& sel = select.has_value() ? *select : probs;
  check_f32(sel, "select", S, E);
  auto i64 = probs.options().dtype(at::kLong);
  at::Tensor expert_index = at::empty({S, k}, i64), rows = at::empty({S, k}, i64);
  at::Tensor chosen = at::empty({S, k}, probs.options()), weights = at::empty({S, k}, probs.options());
  at::Tensor kept = at::empty({S, k}, probs.options().dtype(at::kBool));
  at::Tensor exp_counts = at::empty({E}, i64), kept_counts = at::empty({E}, i64), first_counts = at::empty({E}, i64);
  at::Tensor prob_sum = at::empty({E}, probs.options()), order = at::empty({S * k}, i64);

  const float* p = probs.const_data_ptr<float>();
  const float* s = sel.const_data_ptr<float>();
  int64_t* idx = expert_index.data_ptr<int64_t>();
  float* ch = chosen.data_ptr<float>();
  const int threads = S * E > (1 << 14) ? at::get_num_threads() : 1;
  const int64_t chunks = threads, per = (S + chunks - 1) / chunks;
  // cnt[(c * k + j) * E + e]: assignments of choice j in chunk c to expert e; psum[c * E + e].
  std::vector<int64_t> cnt(chunks * k * E, 0);
  std::vector<double> psum(chunks * E, 0.0);

#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t* my_cnt = cnt.data() + c * k * E;
    double* my_sum = psum.data() + c * E;
    for (int64_t t = c * per, end = std::min(S, (c + 1) * per); t < end; ++t) {
      const float* pt = p + t * E;
      int64_t* it = idx + t * k;
      topk_row(s + t * E, E, k, it);
      for (int64_t j = 0; j < k; ++j) {
        ch[t * k + j] = pt[it[j]];
        ++my_cnt[j * E + it[j]];
      }
      for (int64_t e = 0; e < E; ++e) my_sum[e] += pt[e];
    }
  }

  // Totals, then where each (choice, chunk) block of each expert starts in choice-major order.
  int64_t* ec = exp_counts.data_ptr<int64_t>();
  int64_t* kc = kept_counts.data_ptr<int64_t>();
  int64_t* fc = first_counts.data_ptr<int64_t>();
  float* ps = prob_sum.data_ptr<float>();
  std::vector<int64_t> base(chunks * k * E);
  for (int64_t e = 0; e < E; ++e) {
    int64_t acc = 0;
    for (int64_t j = 0; j < k; ++j)
      for (int64_t c = 0; c < chunks; ++c) {
        base[(c * k + j) * E + e] = acc;
        acc += cnt[(c * k + j) * E + e];
      }
    ec[e] = acc;
    kc[e] = capacity < 0 ? acc : std::min(acc, capacity);
    int64_t first = 0;
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      first += cnt[c * k * E + e];
      sum += psum[c * E + e];
    }
    fc[e] = first;
    ps[e] = static_cast<float>(sum);
  }
  std::vector<int64_t> kept_start(E), all_start(E);
  int64_t kept_total = 0;
  for (int64_t e = 0, all = 0; e < E; ++e) {
    kept_start[e] = kept_total;
    all_start[e] = all;
    kept_total += kc[e];
    all += ec[e];
  }
  at::Tensor index = at::empty({kept_total}, i64);
  int64_t* ix = index.data_ptr<int64_t>();
  int64_t* rw = rows.data_ptr<int64_t>();
  int64_t* od = order.data_ptr<int64_t>();
  bool* kp = kept.data_ptr<bool>();
  float* w = weights.data_ptr<float>();

#pragma omp parallel for schedule(static, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t* next = base.data() + c * k * E;  // running positions of this chunk, per (choice, expert)
    for (int64_t t = c * per, end = std::min(S, (c + 1) * per); t < end; ++t) {
      float total = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = idx[t * k + j];
        const int64_t pos = next[j * E + e]++;
        const bool keep = capacity < 0 || pos < capacity;
        kp[t * k + j] = keep;
        od[all_start[e] + pos] = j * S + t;
        if (keep) {
          const int64_t r = kept_start[e] + pos;
          rw[t * k + j] = r;
          ix[r] = t;
          w[t * k + j] = ch[t * k + j];
          total += ch[t * k + j];
        } else {
          rw[t * k + j] = -1;
          w[t * k + j] = 0.f;
        }
      }
      if (renormalize) {
        const float d = std::max(total, kEps);
        for (int64_t j = 0; j < k; ++j) w[t * k + j] /= d;
      }
    }
  }
  return {expert_index, chosen, kept, weights, exp_counts, kept_counts, first_counts, prob_sum, rows, index, order};
}

// d loss / d logits, given d loss / d weights (grad_weights [S,k]) and the load-balancing term's
// per-expert coefficient (aux_coef [E] = d loss / d probs[t, e], the same for every token):
//   d/d chosen_j = kept_j * (renormalize ? (gw_j - sum_i gw_i w_i) / D : gw_j),  D = max(sum_j chosen_j kept_j, eps)
//   gp[e] = aux_coef[e] + sum_j [idx_j == e] d/d chosen_j
//   grad_logits = p * (gp - <p, gp>)                                  (the softmax Jacobian)
at::Tensor topk_gate_backward(const at::Tensor& probs, const at::Tensor& expert_index, const at::Tensor& chosen,
                              const at::Tensor& kept, const at::Tensor& grad_weights, const at::Tensor& aux_coef,
                              bool renormalize) {
  const int64_t S = probs.size(0), E = probs.size(1), k = expert_index.size(1);
  check_f32(probs, "probs", S, E);
  check_f32(chosen, "chosen", S, k);
  check_f32(grad_weights, "grad_weights", S, k);
  TORCH_CHECK(expert_index.scalar_type() == at::kLong && expert_index.is_contiguous() && kept.is_contiguous() &&
                  kept.scalar_type() == at::kBool && aux_coef.scalar_type() == at::kFloat &&
                  aux_coef.is_contiguous() && aux_coef.numel() == E,
              "moe topk gate: bad backward inputs");
  at::Tensor grad = at::empty({S, E}, probs.options());
  const float* p = probs.const_data_ptr<float>();
  const int64_t* idx = expert_index.const_data_ptr<int64_t>();
  const float* ch = chosen.const_data_ptr<float>();
  const bool* kp = kept.const_data_ptr<bool>();
  const float* gw = grad_weights.const_data_ptr<float>();
  const float* ac = aux_coef.const_data_ptr<float>();
  float* g = grad.data_ptr<float>();
  // <p, aux_coef> per token is the dense part of <p, gp>.
  const int threads = S * E > (1 << 14) ? at::get_num_threads() : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < S; ++t) {
    const float* pt = p + t * E;
    float dc[8];
    float total = 0.f, dot_gw = 0.f;
    for (int64_t j = 0; j < k; ++j) total += kp[t * k + j] ? ch[t * k + j] : 0.f;
    const float d = std::max(total, kEps);
    if (renormalize)
      for (int64_t j = 0; j < k; ++j)
        if (kp[t * k + j]) dot_gw += gw[t * k + j] * (ch[t * k + j] / d);
    for (int64_t j = 0; j < k; ++j) {
      const float gj = gw[t * k + j];
      dc[j] = !kp[t * k + j] ? 0.f : (renormalize ? (total >= kEps ? (gj - dot_gw) / d : gj / d) : gj);
    }
    float dot = 0.f;
    for (int64_t e = 0; e < E; ++e) dot += pt[e] * ac[e];
    for (int64_t j = 0; j < k; ++j) dot += pt[idx[t * k + j]] * dc[j];
    float* gt = g + t * E;
    for (int64_t e = 0; e < E; ++e) gt[e] = pt[e] * (ac[e] - dot);
    for (int64_t j = 0; j < k; ++j) gt[idx[t * k + j]] += pt[idx[t * k + j]] * dc[j];
  }
  return grad;
}

}  // namespace moe
}  // namespace ze
