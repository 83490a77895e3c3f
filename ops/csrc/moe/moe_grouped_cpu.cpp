// Per-expert GEMMs over expert-contiguous rows, on CPU.
//
// Why not one bmm: dropless routing gives every expert a different row count, and a padded
// bmm pays for the largest one everywhere. Why not a Python loop of torch.mm: each call is
// its own two-thread parallel region, and on a shared machine a region whose second thread
// is descheduled waits a whole time slice, hundreds of times per step. Here all experts run
// in one OpenMP region, each GEMM single-threaded inside it (MKL and ATen do not nest), the
// biggest first so the dynamic schedule balances uneven experts. With fewer experts than
// 2 x threads the GEMMs run one after another, each using every thread. A GEMM that runs on one
// thread over few rows uses the small-row kernels of moe_small_gemm_cpu.cpp (fp32, AVX2 + FMA),
// which read the expert's weight once instead of packing it first.
#include <algorithm>
#include <numeric>

#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/core/GradMode.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/sum_cpu_dispatch.h>

#include "moe_cpu.h"
#include "moe_small_gemm.h"

namespace ze {
namespace moe {
namespace {

struct Spans {
  std::vector<int64_t> start, count, order;  // order: experts by descending row count
};

Spans spans_of(const std::vector<int64_t>& counts, int64_t rows) {
  Spans s;
  const int64_t n = static_cast<int64_t>(counts.size());
  s.start.resize(n);
  s.count = counts;
  int64_t acc = 0;
  for (int64_t e = 0; e < n; ++e) {
    TORCH_CHECK(counts[e] >= 0, "moe grouped: negative count");
    s.start[e] = acc;
    acc += counts[e];
  }
  TORCH_CHECK(acc == rows, "moe grouped: counts sum to ", acc, " but there are ", rows, " rows");
  s.order.resize(n);
  std::iota(s.order.begin(), s.order.end(), 0);
  std::stable_sort(s.order.begin(), s.order.end(), [&](int64_t a, int64_t b) { return counts[a] > counts[b]; });
  return s;
}

// Runs fn(e, one_thread) for every expert: in one OpenMP region when there are enough experts to
// share out; one_thread says the expert's GEMMs run on the calling thread alone.
// Worker threads start with autograd on (thread-local state is not inherited): each ATen call
// here must skip the autograd kernels, which would otherwise record history on the weights and
// take the GIL the calling thread holds (a deadlock, seen with addmm's bias copy).
template <typename Fn>
void for_each_expert(const Spans& s, Fn fn) {
  const int64_t n = static_cast<int64_t>(s.order.size());
  const int threads = at::get_num_threads();
  const bool shared_out = threads > 1 && n >= 2 * threads;
  auto run = [&](int64_t i) {
    c10::AutoGradMode no_grad(false);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    fn(s.order[i], shared_out || threads == 1);
  };
  if (shared_out) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) run(i);
  } else {
    for (int64_t i = 0; i < n; ++i) run(i);
  }
}

// Whether an expert's GEMM over `rows` rows goes to the small-row kernels.
bool small_rows(int64_t rows, bool one_thread, const at::Tensor& a) {
  return one_thread && rows <= small_gemm::kMaxRows && a.scalar_type() == at::kFloat && small_gemm::enabled();
}

}  // namespace

void grouped_rows_mm(const at::Tensor& a, const std::vector<at::Tensor>& w, const std::vector<int64_t>& counts,
                     const std::vector<at::Tensor>& bias, bool trans_w, at::Tensor out) {
  TORCH_CHECK(a.dim() == 2 && out.dim() == 2 && a.size(0) == out.size(0) && a.is_contiguous() && out.is_contiguous(),
              "moe grouped: a and out must be contiguous [rows, *] with the same rows");
  // every check before the parallel region: an error thrown inside it aborts the process
  TORCH_CHECK(out.scalar_type() == a.scalar_type(), "moe grouped: out must have a's dtype");
  TORCH_CHECK(w.size() == counts.size() && (bias.empty() || bias.size() == counts.size()),
              "moe grouped: one weight (and bias) per expert");
  const int64_t k_dim = a.size(1), n_dim = out.size(1);
  for (size_t e = 0; e < w.size(); ++e) {
    TORCH_CHECK(w[e].dim() == 2 && w[e].scalar_type() == a.scalar_type() && w[e].device().is_cpu(),
                "moe grouped: weights must be 2-d CPU tensors of a's dtype");
    const int64_t wk = trans_w ? w[e].size(1) : w[e].size(0), wn = trans_w ? w[e].size(0) : w[e].size(1);
    TORCH_CHECK(wk == k_dim && wn == n_dim, "moe grouped: weight ", e, " has the wrong shape");
    if (!bias.empty())
      TORCH_CHECK(bias[e].dim() == 1 && bias[e].size(0) == n_dim && bias[e].scalar_type() == a.scalar_type(),
                  "moe grouped: bias ", e, " has the wrong shape or dtype");
  }
  const Spans s = spans_of(counts, a.size(0));
  for_each_expert(s, [&](int64_t e, bool one_thread) {
    if (s.count[e] == 0) return;
    // (a zero-width contraction has no tile to write: ATen fills in the bias or zeros)
    if (small_rows(s.count[e], one_thread, a) && k_dim > 0 && w[e].is_contiguous() &&
        (bias.empty() || bias[e].is_contiguous())) {
      const float* x = a.const_data_ptr<float>() + s.start[e] * k_dim;
      float* o = out.mutable_data_ptr<float>() + s.start[e] * n_dim;
      if (trans_w) {
        small_gemm::nt(x, w[e].const_data_ptr<float>(), bias.empty() ? nullptr : bias[e].const_data_ptr<float>(), o,
                       s.count[e], n_dim, k_dim);
        return;
      }
      if (bias.empty()) {
        small_gemm::nn(x, w[e].const_data_ptr<float>(), o, s.count[e], k_dim, n_dim);
        return;
      }
    }
    at::Tensor o = out.narrow(0, s.start[e], s.count[e]);
    const at::Tensor x = a.narrow(0, s.start[e], s.count[e]);
    const at::Tensor m = trans_w ? w[e].t() : w[e];
    if (bias.empty()) {
      at::cpu::mm_out(o, x, m);
    } else {
      at::cpu::addmm_out(o, bias[e], x, m);
    }
  });
}

void grouped_weight_grad(const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& counts,
                         at::Tensor out, const std::optional<at::Tensor>& bias_out) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(0) && a.is_contiguous() && b.is_contiguous(),
              "moe grouped: a and b must be contiguous [rows, *] with the same rows");
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "moe grouped: b must have a's dtype");
  const int64_t num = static_cast<int64_t>(counts.size());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == num && out.size(1) == a.size(1) && out.size(2) == b.size(1) &&
                  out.is_contiguous() && out.scalar_type() == a.scalar_type(),
              "moe grouped: out must be a contiguous [experts, a cols, b cols] tensor of a's dtype");
  if (bias_out.has_value())
    TORCH_CHECK(bias_out->dim() == 2 && bias_out->size(0) == num && bias_out->size(1) == a.size(1) &&
                    bias_out->is_contiguous() && bias_out->scalar_type() == a.scalar_type(),
                "moe grouped: bias_out must be a contiguous [experts, a cols] tensor of a's dtype");
  const Spans s = spans_of(counts, a.size(0));
  for_each_expert(s, [&](int64_t e, bool one_thread) {
    at::Tensor o = out.select(0, e);
    if (s.count[e] == 0) {
      o.zero_();
      if (bias_out.has_value()) bias_out->select(0, e).zero_();
      return;
    }
    const at::Tensor ae = a.narrow(0, s.start[e], s.count[e]);
    if (small_rows(s.count[e], one_thread, a)) {
      small_gemm::tn(ae.const_data_ptr<float>(), b.const_data_ptr<float>() + s.start[e] * b.size(1),
                     o.mutable_data_ptr<float>(), s.count[e], a.size(1), b.size(1));
    } else {
      at::cpu::mm_out(o, ae.t(), b.narrow(0, s.start[e], s.count[e]));
    }
    if (bias_out.has_value()) {
      at::Tensor bo = bias_out->select(0, e);
      const int64_t rows_dim[1] = {0};
      at::cpu::sum_out(bo, ae, at::IntArrayRef(rows_dim, 1));
    }
  });
}

}  // namespace moe
}  // namespace ze
