// Token permutation for Mixture-of-Experts on CPU (OpenMP over tokens).
//
// See moe_dispatch.h for the three operations. The Python wrapper
// (zeroengine/ops/moe_dispatch.py) builds the index maps; these kernels only
// move rows, so their cost is one pass over the activations: a gather is a
// memcpy per row, a combine reads k rows and writes one, accumulating in fp32
// (fp64 for double) without materialising the [tokens, k, dim] intermediate
// the PyTorch reference needs. The combine kernels reach rows through a row-pointer table, so
// the permuted rows may also be one tensor per expert (the *_segments / gather_rows_split
// variants: experts run module by module need no concatenation either way). This module also
// registers the grouped-GEMM and fused-gate kernels (moe_cpu.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

#include "moe_cpu.h"
#include "moe_small_gemm.h"

namespace ze {
namespace moe {
namespace {

// Below this many elements one thread is faster than waking the team.
constexpr int64_t kParallelGrain = 1 << 15;

void check_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), "moe_dispatch: ", what, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "moe_dispatch: ", what, " must be a contiguous 2-d tensor");
}

void check_index(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
              "moe_dispatch: ", what, " must be a contiguous int64 CPU tensor");
}

const float* weights_ptr(const std::optional<at::Tensor>& w, const at::Tensor& rows) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->sizes() == rows.sizes(),
              "moe_dispatch: weights must be contiguous float32 shaped like rows");
  return w->data_ptr<float>();
}

// Index maps are checked up front, serially: the kernels then never meet a bad index inside an
// OpenMP region (where an exception cannot propagate).
void check_range(const at::Tensor& idx, int64_t lo, int64_t n, const char* op) {
  const int64_t* p = idx.const_data_ptr<int64_t>();
  for (int64_t i = 0, count = idx.numel(); i < count; ++i)
    TORCH_CHECK(p[i] >= lo && p[i] < n, "moe_dispatch.", op, ": index ", p[i], " out of range [0, ", n, ")");
}

// A dot product with eight independent partial sums (written so without -ffast-math; gcc still
// keeps it scalar, which made the combine weights' gradient ~4x slower than its one pass over the rows).
template <typename T, typename Acc>
inline Acc dot(const T* a, const T* b, int64_t n) {
  Acc s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int l = 0; l < 8; ++l) s[l] += static_cast<Acc>(a[c + l]) * static_cast<Acc>(b[c + l]);
  Acc total = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; c < n; ++c) total += static_cast<Acc>(a[c]) * static_cast<Acc>(b[c]);
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// fp32 on AVX2: four 8-lane accumulators (one FMA chain would wait on its own latency).
template <>
inline float dot<float, float>(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  int64_t c = 0;
  for (; c + 32 <= n; c += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 16), _mm256_loadu_ps(b + c + 16), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 24), _mm256_loadu_ps(b + c + 24), s3);
  }
  for (; c + 8 <= n; c += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
  const __m256 s = _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3));
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  float total = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  for (; c < n; ++c) total += a[c] * b[c];
  return total;
}
#endif

// Row pointers of one [n, d] tensor, or of several [n_i, d] tensors taken as their concatenation.
template <typename T>
std::vector<T*> row_table(const std::vector<at::Tensor>& parts, int64_t d) {
  int64_t n = 0;
  for (const auto& p : parts) n += p.size(0);
  std::vector<T*> table(n);
  int64_t r = 0;
  for (const auto& p : parts) {
    T* base = static_cast<T*>(const_cast<void*>(p.const_data_ptr()));
    for (int64_t i = 0, rows = p.size(0); i < rows; ++i) table[r++] = base + i * d;
  }
  return table;
}

// acc[0, d) = sum over token t's kept assignments j of w[t, j] * y[rows[t, j]] (w null: weight 1),
// zeros when none is kept. The first kept row is assigned, not added to zeros (one pass less).
template <typename T, typename Acc>
inline void combine_token(const T* const* yrow, const int64_t* rows, const float* w, int64_t t, int64_t k, int64_t d,
                          Acc* acc) {
  bool first = true;
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = rows[t * k + j];
    if (r < 0) continue;
    const Acc wj = w ? static_cast<Acc>(w[t * k + j]) : Acc(1);
    const T* yr = yrow[r];
    if (first) {
      for (int64_t c = 0; c < d; ++c) acc[c] = wj * static_cast<Acc>(yr[c]);
      first = false;
    } else {
      for (int64_t c = 0; c < d; ++c) acc[c] += wj * static_cast<Acc>(yr[c]);
    }
  }
  if (first) std::fill(acc, acc + d, Acc(0));
}

// Rows of y are reached through a table of row pointers, so y may be one tensor or the expert
// outputs as separate tensors (no concatenation copy; see combine_segments).
template <typename T>
void combine_kernel(const T* const* yrow, const int64_t* rows, const float* w, T* out, int64_t tokens, int64_t k,
                    int64_t d) {
  using Acc = at::opmath_type<T>;
  constexpr bool kInPlace = std::is_same_v<T, Acc>;  // accumulate straight into the output row
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads) if (tokens * d * k > kParallelGrain)
  {
    std::vector<Acc> buf(kInPlace ? 0 : d);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
      Acc* acc = kInPlace ? reinterpret_cast<Acc*>(out + t * d) : buf.data();
      combine_token<T, Acc>(yrow, rows, w, t, k, d, acc);
      if constexpr (!kInPlace) {
        T* o = out + t * d;
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c]);
      }
    }
  }
}

template <typename T>
void combine_backward_kernel(const T* g, const T* const* yrow, const int64_t* rows, const float* w,
                             T* const* grad_yrow, float* grad_w, int64_t tokens, int64_t k, int64_t d) {
  using Acc = at::opmath_type<T>;
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * d * k > kParallelGrain)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gt = g + t * d;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = rows[t * k + j];
      if (r < 0) {
        if (grad_w) grad_w[t * k + j] = 0.f;
        continue;
      }
      if (grad_yrow) {
        T* gy = grad_yrow[r];
        if (w == nullptr) {
          std::memcpy(gy, gt, d * sizeof(T));
        } else {
          const Acc wj = static_cast<Acc>(w[t * k + j]);
          for (int64_t c = 0; c < d; ++c) gy[c] = static_cast<T>(wj * static_cast<Acc>(gt[c]));
        }
      }
      if (grad_w) grad_w[t * k + j] = static_cast<float>(dot<T, Acc>(gt, yrow[r], d));
    }
  }
}

}  // namespace

// out[i] = x[index[i]]: a row copy, whatever the dtype.
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index) {
  check_2d(x, "x");
  check_index(index, "index");
  const int64_t n = index.numel(), n_in = x.size(0), d = x.size(1);
  at::Tensor out = at::empty({n, d}, x.options());
  const size_t row_bytes = d * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  check_range(index, 0, n_in, "gather_rows");
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (n * d > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, src + idx[i] * row_bytes, row_bytes);
  return out;
}

// The segments: expert outputs [n_e, d] taken as one [sum n_e, d] tensor (rows index into it).
static int64_t check_segments(const std::vector<at::Tensor>& ys, const char* what) {
  TORCH_CHECK(!ys.empty(), "moe_dispatch: ", what, " needs at least one tensor");
  int64_t n = 0;
  for (const auto& y : ys) {
    check_2d(y, what);
    TORCH_CHECK(y.scalar_type() == ys[0].scalar_type() && y.size(1) == ys[0].size(1),
                "moe_dispatch: ", what, " tensors must share dtype and width");
    n += y.size(0);
  }
  return n;
}

at::Tensor combine_segments(const std::vector<at::Tensor>& ys, const at::Tensor& rows,
                            const std::optional<at::Tensor>& weights) {
  const int64_t n = check_segments(ys, "y");
  check_index(rows, "rows");
  TORCH_CHECK(rows.dim() == 2, "moe_dispatch: rows must be [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const int64_t tokens = rows.size(0), k = rows.size(1), d = ys[0].size(1);
  check_range(rows, -1, n, "combine_rows");  // -1: a dropped assignment
  at::Tensor out = at::empty({tokens, d}, ys[0].options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ys[0].scalar_type(), "combine_rows", [&] {
    const std::vector<scalar_t*> yrow = row_table<scalar_t>(ys, d);
    combine_kernel<scalar_t>(yrow.data(), rows.const_data_ptr<int64_t>(), w, out.data_ptr<scalar_t>(), tokens, k, d);
  });
  return out;
}

// combine_segments(ys, rows, None) + a @ w, fp32: the backward of the gather-and-route node, where the
// rows' gradients come back to token order and the router's input gradient (a = d logits, w = the
// router weight) is added. Done per block of tokens, the add happens while the block is in cache:
// as two calls it was one more pass writing and re-reading the whole [tokens, d] result.
at::Tensor combine_segments_addmm(const std::vector<at::Tensor>& ys, const at::Tensor& rows, const at::Tensor& a,
                                  const at::Tensor& w) {
  TORCH_CHECK(small_gemm::available(), "moe_dispatch.combine_segments_addmm needs the AVX2 small-row GEMMs");
  const int64_t n = check_segments(ys, "y");
  check_index(rows, "rows");
  TORCH_CHECK(rows.dim() == 2, "moe_dispatch: rows must be [tokens, k]");
  const int64_t tokens = rows.size(0), k = rows.size(1), d = ys[0].size(1);
  TORCH_CHECK(ys[0].scalar_type() == at::kFloat, "moe_dispatch.combine_segments_addmm: float32 only");
  check_2d(a, "a");
  check_2d(w, "w");
  TORCH_CHECK(a.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && a.size(0) == tokens &&
                  w.size(0) == a.size(1) && w.size(1) == d,
              "moe_dispatch.combine_segments_addmm: a must be float32 [tokens, e] and w float32 [e, d]");
  check_range(rows, -1, n, "combine_segments_addmm");
  at::Tensor out = at::empty({tokens, d}, ys[0].options());
  const std::vector<float*> yrow = row_table<float>(ys, d);
  const int64_t* r = rows.const_data_ptr<int64_t>();
  const float* ap = a.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t e = a.size(1);
  constexpr int64_t kBlock = 48;  // tokens per block: 48 rows of d = 512 floats stay in L2 for the add
  const int64_t blocks = (tokens + kBlock - 1) / kBlock;
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (tokens * d * k > kParallelGrain)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t t0 = b * kBlock, t1 = std::min(tokens, t0 + kBlock);
    for (int64_t t = t0; t < t1; ++t) combine_token<float, float>(yrow.data(), r, nullptr, t, k, d, op + t * d);
    small_gemm::nn(ap + t0 * e, wp, op + t0 * d, t1 - t0, e, d, /*accumulate=*/true);
  }
  return out;
}

at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& rows, const std::optional<at::Tensor>& weights) {
  return combine_segments({y}, rows, weights);
}

// Returns (grad_w or undefined, grad_y per segment...) (no grad_y entries unless need_grad_y).
// `zero_grad_y` must be set unless every row of y is named by exactly one (t, j).
std::vector<at::Tensor> combine_segments_backward(const at::Tensor& grad, const std::vector<at::Tensor>& ys,
                                                  const at::Tensor& rows, const std::optional<at::Tensor>& weights,
                                                  bool need_grad_y, bool need_grad_w, bool zero_grad_y) {
  check_2d(grad, "grad");
  const int64_t n = check_segments(ys, "y");
  check_index(rows, "rows");
  TORCH_CHECK(grad.scalar_type() == ys[0].scalar_type(), "moe_dispatch: grad and y dtypes differ");
  TORCH_CHECK(rows.dim() == 2 && grad.size(0) == rows.size(0) && grad.size(1) == ys[0].size(1),
              "moe_dispatch: grad must be [tokens, dim] and rows [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const int64_t tokens = rows.size(0), k = rows.size(1), d = ys[0].size(1);
  check_range(rows, -1, n, "combine_rows_backward");
  std::vector<at::Tensor> out;
  out.push_back(need_grad_w ? at::empty({tokens, k}, rows.options().dtype(at::kFloat)) : at::Tensor());
  if (need_grad_y)
    for (const auto& y : ys) out.push_back(zero_grad_y ? at::zeros_like(y) : at::empty_like(y));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ys[0].scalar_type(), "combine_rows_backward", [&] {
    const std::vector<scalar_t*> yrow = row_table<scalar_t>(ys, d);
    std::vector<scalar_t*> grow;
    if (need_grad_y) grow = row_table<scalar_t>(std::vector<at::Tensor>(out.begin() + 1, out.end()), d);
    combine_backward_kernel<scalar_t>(grad.const_data_ptr<scalar_t>(), yrow.data(), rows.const_data_ptr<int64_t>(),
                                      w, need_grad_y ? grow.data() : nullptr,
                                      need_grad_w ? out[0].data_ptr<float>() : nullptr, tokens, k, d);
  });
  return out;
}

std::vector<at::Tensor> combine_rows_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rows,
                                              const std::optional<at::Tensor>& weights, bool need_grad_y,
                                              bool need_grad_w, bool zero_grad_y) {
  std::vector<at::Tensor> r = combine_segments_backward(grad, {y}, rows, weights, need_grad_y, need_grad_w,
                                                        zero_grad_y);
  return {need_grad_y ? r[1] : at::Tensor(), r[0]};
}

// gather_rows into one tensor per expert: segment e holds rows counts[0] + ... + counts[e-1] onwards.
std::vector<at::Tensor> gather_rows_split(const at::Tensor& x, const at::Tensor& index,
                                          const std::vector<int64_t>& counts) {
  check_2d(x, "x");
  check_index(index, "index");
  const int64_t n = index.numel(), d = x.size(1);
  int64_t total = 0;
  std::vector<at::Tensor> out;
  for (int64_t c : counts) {
    TORCH_CHECK(c >= 0, "moe_dispatch: negative count");
    out.push_back(at::empty({c, d}, x.options()));
    total += c;
  }
  TORCH_CHECK(total == n, "moe_dispatch: counts sum to ", total, " but index has ", n, " rows");
  check_range(index, 0, x.size(0), "gather_rows");
  const std::vector<char*> dst = row_table<char>(out, d * x.element_size());
  const size_t row_bytes = d * x.element_size();
  const char* src = static_cast<const char*>(x.const_data_ptr());
  const int64_t* idx = index.const_data_ptr<int64_t>();
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(static) num_threads(threads) if (n * d > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst[i], src + idx[i] * row_bytes, row_bytes);
  return out;
}

}  // namespace moe
}  // namespace ze

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine MoE token permutation (CPU)";
  m.def("gather_rows", &ze::moe::gather_rows, py::arg("x"), py::arg("index"));
  m.def("combine_rows", &ze::moe::combine_rows, py::arg("y"), py::arg("rows"), py::arg("weights"));
  m.def("gather_rows_split", &ze::moe::gather_rows_split, py::arg("x"), py::arg("index"), py::arg("counts"));
  m.def("combine_segments", &ze::moe::combine_segments, py::arg("ys"), py::arg("rows"), py::arg("weights"));
  m.def("combine_segments_addmm", &ze::moe::combine_segments_addmm, py::arg("ys"), py::arg("rows"), py::arg("a"),
        py::arg("w"));
  m.def("combine_segments_backward", &ze::moe::combine_segments_backward, py::arg("grad"), py::arg("ys"),
        py::arg("rows"), py::arg("weights"), py::arg("need_grad_y"), py::arg("need_grad_w"), py::arg("zero_grad_y"));
  m.def("combine_rows_backward", &ze::moe::combine_rows_backward, py::arg("grad"), py::arg("y"), py::arg("rows"),
        py::arg("weights"), py::arg("need_grad_y"), py::arg("need_grad_w"), py::arg("zero_grad_y"));
  // moe_grouped_cpu.cpp
  m.def("grouped_rows_mm", &ze::moe::grouped_rows_mm, py::arg("a"), py::arg("w"), py::arg("counts"),
        py::arg("bias"), py::arg("trans_w"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("grouped_weight_grad", &ze::moe::grouped_weight_grad, py::arg("a"), py::arg("b"), py::arg("counts"),
        py::arg("out"), py::arg("bias_out"), py::call_guard<py::gil_scoped_release>());
  // moe_small_gemm_cpu.cpp: whether the small-row GEMMs were compiled (AVX2 + FMA), and whether they are also
  // not turned off (ZEROENGINE_MOE_SMALL_GEMM=0): callers use the router's GEMMs and combine_segments_addmm
  // only when enabled
  m.def("small_gemm_compiled", &ze::moe::small_gemm::available);
  m.def("small_gemm_enabled", &ze::moe::small_gemm::enabled);
  // moe_router_cpu.cpp
  m.def("router_logits", &ze::moe::router_logits, py::arg("x"), py::arg("wg"),
        py::call_guard<py::gil_scoped_release>());
  m.def("router_weight_grad", &ze::moe::router_weight_grad, py::arg("grad_logits"), py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  // moe_gate_cpu.cpp
  m.def("topk_gate_forward", &ze::moe::topk_gate_forward, py::arg("probs"), py::arg("select"), py::arg("k"),
        py::arg("capacity"), py::arg("renormalize"));
  m.def("topk_gate_backward", &ze::moe::topk_gate_backward, py::arg("probs"), py::arg("expert_index"),
        py::arg("chosen"), py::arg("kept"), py::arg("grad_weights"), py::arg("aux_coef"), py::arg("renormalize"));
}
