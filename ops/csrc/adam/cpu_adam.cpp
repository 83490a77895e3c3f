// Adam / AdamW step over flat CPU tensors (param, exp_avg, exp_avg_sq), with an
// fp32, bf16 or fp16 gradient and an optional bf16/fp16 copy of the updated
// parameter written in the same pass.
//
// The param and moments are fp32 (master weights), or bf16 for the lean modes
// (bf16.bf16_master_weights_and_grads: a bf16 param with fp32 or bf16 moments):
// every value is widened to fp32 on load, the arithmetic is the fp32 path's, and
// each result is rounded to nearest-even once, when it is stored.
//
// The step is memory bound (28 bytes per fp32 parameter), so the design goal is
// one streaming pass: every array is read and written exactly once, OpenMP
// threads take contiguous blocks, and the SIMD width comes from simd.h.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>

// torch/extension.h would also pull in the whole C++ frontend (torch/all.h) and
// triple the compile time; the Tensor type and its pybind11 casters suffice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "adam_hyper.h"
#include "simd.h"

namespace ze {
namespace {

// Marks "no 16-bit copy requested" in the kernel's template arguments.
struct NoCopy {};

template <typename ParamT, typename GradT, typename StateT, typename CopyT>
struct AdamArrays {
  ParamT* param;
  const GradT* grad;
  StateT* exp_avg;
  StateT* exp_avg_sq;
  CopyT* copy;  // nullptr unless CopyT is a 16-bit type
};

// How far ahead of the element being updated each input array is prefetched:
// enough to cover the memory latency at one core's share of the bandwidth,
// close enough that the lines are still in L1 when used.
constexpr uintptr_t kPrefetchBytes = 1024;

// The address kPrefetchBytes past p, computed on integers: it may lie past the
// end of the array (a prefetch never faults), where pointer arithmetic may not.
inline const void* ahead(const void* p) {
  return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + kPrefetchBytes);
}

// Updates elements [begin, end); Ops::kWidth must divide end - begin.
template <typename Ops, typename ParamT, typename GradT, typename StateT, typename CopyT>
inline void adam_range(const AdamArrays<ParamT, GradT, StateT, CopyT>& a, const AdamHyper& h, int64_t begin,
                       int64_t end) {
  using R = typename Ops::Reg;
  const R beta1 = Ops::set1(h.beta1), beta2 = Ops::set1(h.beta2);
  const R one_minus_beta1 = Ops::set1(1.0f - h.beta1), one_minus_beta2 = Ops::set1(1.0f - h.beta2);
  const R eps = Ops::set1(h.eps), weight_decay = Ops::set1(h.weight_decay);
  const R decay_factor = Ops::set1(h.decay_factor), inv_bc2_sqrt = Ops::set1(h.inv_bc2_sqrt);
  const R neg_step_size = Ops::set1(-h.step_size);
  // Adam's L2 term only where there is one: 0 * an infinite param is NaN, which would poison the moments
  // where torch skips the term (AdamW mode zeroes weight_decay). The branch is the same for every element.
  const bool l2 = h.weight_decay != 0.0f;
  // Local restrict copies of the pointers: read through `a`, the compiler must
  // assume each float store may change them and reloads all of them every
  // iteration (five extra loads per vector, most costly in the copy-out loop).
  ParamT* __restrict param = a.param;
  const GradT* __restrict grad = a.grad;
  StateT* __restrict exp_avg = a.exp_avg;
  StateT* __restrict exp_avg_sq = a.exp_avg_sq;
  CopyT* __restrict copy = a.copy;

  // One vector's worth of elements, starting at i.
  auto update = [&](int64_t i) {
    R p = Ops::load(param + i);
    R g = Ops::load(grad + i);
    // make_adam_hyper zeroes weight_decay in AdamW mode and sets decay_factor to 1
    // in Adam mode, so at most one of the two applies.
    if (l2) g = Ops::fmadd(weight_decay, p, g);  // Adam: L2 term joins the gradient
    p = Ops::mul(p, decay_factor);                // AdamW: decoupled shrink of the param
    const R m = Ops::fmadd(beta1, Ops::load(exp_avg + i), Ops::mul(one_minus_beta1, g));
    const R v = Ops::fmadd(beta2, Ops::load(exp_avg_sq + i),
                           Ops::mul(one_minus_beta2, Ops::mul(g, g)));
    // A true sqrt and division, not rsqrt/rcp estimates refined by Newton
    // steps, so every element rounds as the formula does. The pair bounds the
    // loop in cache (about 1.4 cycles per element on recent Intel cores at
    // either vector width), but at the sizes that matter the step is memory bound.
    const R denom = Ops::fmadd(Ops::sqrt(v), inv_bc2_sqrt, eps);
    p = Ops::fmadd(neg_step_size, Ops::div(m, denom), p);
    Ops::store(exp_avg + i, m);
    Ops::store(exp_avg_sq + i, v);
    Ops::store(param + i, p);
    if constexpr (!std::is_same_v<CopyT, NoCopy>) Ops::store(copy + i, p);
  };

  // The loop walks the arrays a 64-byte line of floats at a time (two AVX2
  // vectors, one AVX-512 vector) and prefetches each input stream
  // kPrefetchBytes ahead. The hardware prefetchers do not cross 4 KiB pages,
  // and with four input streams a core then keeps too few lines in flight:
  // on 50M params (2-core Ice Lake VM, under load) the AVX2 build measured
  // 2-10% faster with it at 1 and 2 threads, the bf16 copy-out 5-9%; the
  // AVX-512 build, whose loads already take a whole line each, moved by -3% to
  // +6%, within that machine's noise. In cache it costs nothing.
  // (Lines of the fp32 arrays: a bf16 array's line covers two steps and is prefetched twice, which is free.)
  constexpr int64_t kLineFloats = 64 / sizeof(float);
  constexpr int64_t kStep = Ops::kWidth > kLineFloats ? Ops::kWidth : kLineFloats;
  int64_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    Ops::prefetch(ahead(param + i));
    Ops::prefetch(ahead(grad + i));
    Ops::prefetch(ahead(exp_avg + i));
    Ops::prefetch(ahead(exp_avg_sq + i));
    for (int64_t j = i; j < i + kStep; j += Ops::kWidth) update(j);
  }
  for (; i < end; i += Ops::kWidth) update(i);
}

// Floats per OpenMP work item: a multiple of every vector width (so only the
// last block has a scalar tail), large enough to amortise scheduling, small
// enough to balance two to a few dozen threads on 1M+ element tensors.
constexpr int64_t kBlock = 16384;

template <typename ParamT, typename GradT, typename StateT, typename CopyT>
void adam_tensor(const AdamArrays<ParamT, GradT, StateT, CopyT>& a, int64_t numel, const AdamHyper& h) {
  const int64_t blocks = (numel + kBlock - 1) / kBlock;
  // Follow torch.set_num_threads so the engine controls CPU use in one place.
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (blocks > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock;
    const int64_t end = std::min(numel, begin + kBlock);
    const int64_t vec_end = begin + (end - begin) / VecOps::kWidth * VecOps::kWidth;
    adam_range<VecOps>(a, h, begin, vec_end);
    adam_range<ScalarOps>(a, h, vec_end, end);
  }
}

template <typename GradT>
void dispatch_copy(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& copy,
                   const AdamHyper& h) {
  float* p = param.data_ptr<float>();
  const GradT* g = static_cast<const GradT*>(grad.const_data_ptr());
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const int64_t n = param.numel();
  if (!copy.has_value()) {
    adam_tensor(AdamArrays<float, GradT, float, NoCopy>{p, g, m, v, nullptr}, n, h);
  } else if (copy->scalar_type() == at::kBFloat16) {
    auto* out = static_cast<c10::BFloat16*>(copy->data_ptr());
    adam_tensor(AdamArrays<float, GradT, float, c10::BFloat16>{p, g, m, v, out}, n, h);
  } else {
    auto* out = static_cast<c10::Half*>(copy->data_ptr());
    adam_tensor(AdamArrays<float, GradT, float, c10::Half>{p, g, m, v, out}, n, h);
  }
}

// A bf16 param (the lean modes): no copy target (the param is already the 16-bit value), an fp32 or
// bf16 gradient (the engine's offloaded bf16 masters step from bf16 ones; a caller may pass fp32 ones).
template <typename GradT, typename StateT>
void dispatch_bf16(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const AdamHyper& h) {
  auto* p = static_cast<c10::BFloat16*>(param.data_ptr());
  const GradT* g = static_cast<const GradT*>(grad.const_data_ptr());
  auto* m = static_cast<StateT*>(exp_avg.data_ptr());
  auto* v = static_cast<StateT*>(exp_avg_sq.data_ptr());
  adam_tensor(AdamArrays<c10::BFloat16, GradT, StateT, NoCopy>{p, g, m, v, nullptr}, param.numel(), h);
}

template <typename StateT>
void dispatch_bf16_grad(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const AdamHyper& h) {
  switch (grad.scalar_type()) {
    case at::kFloat: return dispatch_bf16<float, StateT>(param, grad, exp_avg, exp_avg_sq, h);
    case at::kBFloat16: return dispatch_bf16<c10::BFloat16, StateT>(param, grad, exp_avg, exp_avg_sq, h);
    default: TORCH_CHECK(false, "cpu_adam: a bf16 param takes a float32 or bfloat16 grad, got ", grad.scalar_type());
  }
}

void check_flat(const at::Tensor& t, const char* what, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", what, " must be contiguous");
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", what, " has ", t.numel(),
              " elements, param has ", numel);
}

}  // namespace

// One Adam step on one parameter; `step` is the 1-based step count after this update.
void adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& copy,
               int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool adamw) {
  const int64_t n = param.numel();
  check_flat(param, "param", n);
  check_flat(grad, "grad", n);
  check_flat(exp_avg, "exp_avg", n);
  check_flat(exp_avg_sq, "exp_avg_sq", n);
  TORCH_CHECK(exp_avg.scalar_type() == exp_avg_sq.scalar_type(),
              "cpu_adam: exp_avg and exp_avg_sq must have one dtype");
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1, got ", step);
  const AdamHyper h = make_adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw);
  if (param.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(!copy.has_value(), "cpu_adam: a bf16 param takes no copy target (it is the 16-bit value)");
    switch (exp_avg.scalar_type()) {
      case at::kFloat: return dispatch_bf16_grad<float>(param, grad, exp_avg, exp_avg_sq, h);
      case at::kBFloat16: return dispatch_bf16_grad<c10::BFloat16>(param, grad, exp_avg, exp_avg_sq, h);
      default: TORCH_CHECK(false, "cpu_adam: moments must be float32 or bfloat16, got ", exp_avg.scalar_type());
    }
  }
  TORCH_CHECK(param.scalar_type() == at::kFloat && exp_avg.scalar_type() == at::kFloat,
              "cpu_adam: a float32 param takes float32 moments; a bfloat16 one float32 or bfloat16 "
              "moments (got param ", param.scalar_type(), ", moments ", exp_avg.scalar_type(), ")");
  if (copy.has_value()) {
    check_flat(*copy, "copy target", n);
    TORCH_CHECK(copy->scalar_type() == at::kBFloat16 || copy->scalar_type() == at::kHalf,
                "cpu_adam: copy target must be bfloat16 or float16, got ", copy->scalar_type());
  }
  switch (grad.scalar_type()) {
    case at::kFloat: return dispatch_copy<float>(param, grad, exp_avg, exp_avg_sq, copy, h);
    case at::kBFloat16:
      return dispatch_copy<c10::BFloat16>(param, grad, exp_avg, exp_avg_sq, copy, h);
    case at::kHalf: return dispatch_copy<c10::Half>(param, grad, exp_avg, exp_avg_sq, copy, h);
    default: TORCH_CHECK(false, "cpu_adam: unsupported grad dtype ", grad.scalar_type());
  }
}

}  // namespace ze

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine CPU Adam/AdamW step";
  // The GIL is released so the engine can overlap the step with other Python work.
  m.def("adam_step", &ze::adam_step, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("copy"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"), py::call_guard<py::gil_scoped_release>());
  m.def("simd_level", &ze::simd_level, "SIMD instruction set this build uses");
}
