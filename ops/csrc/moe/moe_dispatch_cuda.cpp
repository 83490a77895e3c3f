// Torch binding of the CUDA token permutation kernels (moe_dispatch.cu):
// checks shapes and dtypes, allocates outputs, launches on the current stream.
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "moe_dispatch.h"

namespace ze {
namespace moe {
namespace {

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    default: TORCH_CHECK(false, "moe_dispatch (CUDA): unsupported dtype ", t);
  }
}

void check_2d(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), "moe_dispatch: ", what, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), "moe_dispatch: ", what, " must be a contiguous 2-d tensor");
}

void check_index(const at::Tensor& t, const at::Tensor& like, const char* what) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == at::kLong && t.is_contiguous(),
              "moe_dispatch: ", what, " must be a contiguous int64 tensor on ", like.device());
}

const float* weights_ptr(const std::optional<at::Tensor>& w, const at::Tensor& rows) {
  if (!w.has_value()) return nullptr;
  TORCH_CHECK(w->device() == rows.device() && w->scalar_type() == at::kFloat && w->is_contiguous() &&
                  w->sizes() == rows.sizes(),
              "moe_dispatch: weights must be contiguous float32 shaped like rows, on rows' device");
  return w->data_ptr<float>();
}

void raise_if(const char* err, const char* op) { TORCH_CHECK(err == nullptr, "moe_dispatch.", op, ": ", err); }

}  // namespace

at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& index) {
  check_2d(x, "x");
  check_index(index, x, "index");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({index.numel(), x.size(1)}, x.options());
  raise_if(gather_rows_cuda(x.const_data_ptr(), index.const_data_ptr<int64_t>(), out.data_ptr(), index.numel(),
                            x.size(0), x.size(1), dtype_of(x.scalar_type()),
                            c10::cuda::getCurrentCUDAStream().stream()),
           "gather_rows");
  return out;
}

at::Tensor combine_rows(const at::Tensor& y, const at::Tensor& rows, const std::optional<at::Tensor>& weights) {
  check_2d(y, "y");
  check_index(rows, y, "rows");
  TORCH_CHECK(rows.dim() == 2, "moe_dispatch: rows must be [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor out = at::empty({rows.size(0), y.size(1)}, y.options());
  raise_if(combine_rows_cuda(y.const_data_ptr(), rows.const_data_ptr<int64_t>(), w, out.data_ptr(), rows.size(0),
                             rows.size(1), y.size(0), y.size(1), dtype_of(y.scalar_type()),
                             c10::cuda::getCurrentCUDAStream().stream()),
           "combine_rows");
  return out;
}

std::vector<at::Tensor> combine_rows_backward(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& rows,
                                              const std::optional<at::Tensor>& weights, bool need_grad_y,
                                              bool need_grad_w, bool zero_grad_y) {
  check_2d(grad, "grad");
  check_2d(y, "y");
  check_index(rows, y, "rows");
  TORCH_CHECK(grad.scalar_type() == y.scalar_type(), "moe_dispatch: grad and y dtypes differ");
  TORCH_CHECK(rows.dim() == 2 && grad.size(0) == rows.size(0) && grad.size(1) == y.size(1),
              "moe_dispatch: grad must be [tokens, dim] and rows [tokens, k]");
  const float* w = weights_ptr(weights, rows);
  const c10::cuda::CUDAGuard guard(y.device());
  at::Tensor grad_y, grad_w;
  if (need_grad_y) grad_y = zero_grad_y ? at::zeros_like(y) : at::empty_like(y);
  if (need_grad_w) grad_w = at::empty({rows.size(0), rows.size(1)}, rows.options().dtype(at::kFloat));
  raise_if(combine_rows_backward_cuda(grad.const_data_ptr(), y.const_data_ptr(), rows.const_data_ptr<int64_t>(), w,
                                      need_grad_y ? grad_y.data_ptr() : nullptr,
                                      need_grad_w ? grad_w.data_ptr<float>() : nullptr, rows.size(0), rows.size(1),
                                      y.size(0), y.size(1), dtype_of(y.scalar_type()),
                                      c10::cuda::getCurrentCUDAStream().stream()),
           "combine_rows_backward");
  return {grad_y, grad_w};
}

}  // namespace moe
}  // namespace ze

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine MoE token permutation (CUDA)";
  m.def("gather_rows", &ze::moe::gather_rows, py::arg("x"), py::arg("index"));
  m.def("combine_rows", &ze::moe::combine_rows, py::arg("y"), py::arg("rows"), py::arg("weights"));
  m.def("combine_rows_backward", &ze::moe::combine_rows_backward, py::arg("grad"), py::arg("y"), py::arg("rows"),
        py::arg("weights"), py::arg("need_grad_y"), py::arg("need_grad_w"), py::arg("zero_grad_y"));
}
