// Token permutation for Mixture-of-Experts on CPU (OpenMP over tokens).
//
// See moe_dispatch.h for the three operations. The Python wrapper
// (zeroengine/ops/moe_dispatch.py) builds the index maps; these kernels only
// move rows, so their cost is one pass over the activations: a gather is a
// memcpy per row, a combine reads k rows and writes one, accumulating in fp32
// (fp64 for double) without materialising the [tokens, k, dim] intermediate
// the PyTorch reference needs.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/utils/pybind.h>

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

// A dot product with eight independent partial sums: vectorises without -ffast-math.
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

template <typename T>
void combine_kernel(const T* y, const int64_t* rows, const float* w, T* out, int64_t tokens, int64_t k,
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
      std::fill(acc, acc + d, Acc(0));
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = rows[t * k + j];
        if (r < 0) continue;
        const Acc wj = w ? static_cast<Acc>(w[t * k + j]) : Acc(1);
        const T* yr = y + r * d;
        for (int64_t c = 0; c < d; ++c) acc[c] += wj * static_cast<Acc>(yr[c]);
      }
      if constexpr (!kInPlace) {
        T* o = out + t * d;
        for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(acc[c]);
      }
    }
  }
}

template <typename T>
void combine_backward_kernel(const T* g, const T* y, const int64_t* rows, const float* w, T* grad_y,
                             float* grad_w, int64_t tokens, int64_t k, int64_t d) {
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
      if (grad_y) {
        T* gy = grad_y + r * d;
        if (w == nullptr) {
          std::memcpy(gy, gt, d * sizeof(T));
        } else {
          const Acc wj = static_cast<Acc>(w[t * k + j]);
          for (int64_t c = 0; c < d; ++c) gy[c] = static_cast<T>(wj * static_cast<Acc>(gt[c]));
        }
      }
      if (grad_w) grad_w[t * k + j] = static_cast<float>(dot<T, Acc>(gt, y + r * d, d));
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

at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& rows, const std::optional<at::Tensor>& weights) {
  check_2d(y, "y");
  check_index(rows, "rows");
  TORCH_CHECK(rows.dim() == 2, "moe_dispatch: rows must be [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const int64_t tokens = rows.size(0), k = rows.size(1), d = y.size(1);
  check_range(rows, -1, y.size(0), "combine_rows");  // -1: a dropped assignment
  at::Tensor out = at::empty({tokens, d}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "combine_rows", [&] {
    combine_kernel<scalar_t>(y.const_data_ptr<scalar_t>(), rows.const_data_ptr<int64_t>(), w,
                             out.data_ptr<scalar_t>(), tokens, k, d);
  });
  return out;
}

// Returns (grad_y or undefined, grad_w or undefined). `zero_grad_y` must be set
// unless every row of y is named by exactly one (t, j).
std::vector<at::Tensor> combine_rows_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rows,
                                              const std::optional<at::Tensor>& weights, bool need_grad_y,
                                              bool need_grad_w, bool zero_grad_y) {
  check_2d(grad, "grad");
  check_2d(y, "y");
  check_index(rows, "rows");
  TORCH_CHECK(grad.scalar_type() == y.scalar_type(), "moe_dispatch: grad and y dtypes differ");
  TORCH_CHECK(rows.dim() == 2 && grad.size(0) == rows.size(0) && grad.size(1) == y.size(1),
              "moe_dispatch: grad must be [tokens, dim] and rows [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const int64_t tokens = rows.size(0), k = rows.size(1), d = y.size(1);
  check_range(rows, -1, y.size(0), "combine_rows_backward");
  at::Tensor grad_y, grad_w;
  if (need_grad_y) grad_y = zero_grad_y ? at::zeros_like(y) : at::empty_like(y);
  if (need_grad_w) grad_w = at::empty({tokens, k}, rows.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "combine_rows_backward", [&] {
    combine_backward_kernel<scalar_t>(grad.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
                                      rows.const_data_ptr<int64_t>(), w,
                                      need_grad_y ? grad_y.data_ptr<scalar_t>() : nullptr,
                                      need_grad_w ? grad_w.data_ptr<float>() : nullptr, tokens, k, d);
  });
  return {grad_y, grad_w};
}

}  // namespace moe
}  // namespace ze

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine MoE token permutation (CPU)";
  m.def("gather_rows", &ze::moe::gather_rows, py::arg("x"), py::arg("index"));
  m.def("combine_rows", &ze::moe::combine_rows, py::arg("y"), py::arg("rows"), py::arg("weights"));
  m.def("combine_rows_backward", &ze::moe::combine_rows_backward, py::arg("grad"), py::arg("y"), py::arg("rows"),
        py::arg("weights"), py::arg("need_grad_y"), py::arg("need_grad_w"), py::arg("zero_grad_y"));
}
