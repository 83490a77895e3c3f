// Torch binding of the CUDA multi-tensor Adam (fused_adam.cu): validates the
// tensor lists, turns them into raw pointers and launches on the current stream.
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include "fused_adam.h"

namespace ze {
namespace {

ParamType param_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ParamType::kFloat32;
    case at::kBFloat16: return ParamType::kBFloat16;
    case at::kHalf: return ParamType::kFloat16;
    default: TORCH_CHECK(false, "fused_adam: unsupported param dtype ", t);
  }
}

}  // namespace

// One Adam step on tensors that share a device, a param dtype and a step count
// (the caller groups them); `step` is the 1-based count after this update.
void fused_adam(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay, bool adamw) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fused_adam: params, grads, exp_avgs and exp_avg_sqs differ in length");
  TORCH_CHECK(step >= 1, "fused_adam: step must be >= 1, got ", step);
  if (n == 0) return;
  const at::Device device = params[0].device();
  const at::ScalarType dtype = params[0].scalar_type();
  TORCH_CHECK(device.is_cuda(), "fused_adam: params must be CUDA tensors");

  std::vector<AdamTensorPtrs> ptrs;
  ptrs.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const at::Tensor& g = grads[i];
    const at::Tensor& m = exp_avgs[i];
    const at::Tensor& v = exp_avg_sqs[i];
    for (const at::Tensor* t : {&p, &g, &m, &v}) {
      TORCH_CHECK(t->device() == device, "fused_adam: all tensors must be on ", device);
      TORCH_CHECK(t->is_contiguous(), "fused_adam: tensors must be contiguous");
      TORCH_CHECK(t->numel() == p.numel(), "fused_adam: tensor ", i, " sizes differ");
    }
    TORCH_CHECK(p.scalar_type() == dtype && g.scalar_type() == dtype,
                "fused_adam: params and grads of one call must share one dtype");
    TORCH_CHECK(m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                "fused_adam: exp_avg and exp_avg_sq must be float32");
    ptrs.push_back({p.data_ptr(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(),
                    p.numel()});
  }

  const c10::cuda::CUDAGuard guard(device);
  const AdamHyper h = make_adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw);
  const char* err = fused_adam_cuda(ptrs.data(), static_cast<int64_t>(ptrs.size()),
                                    param_type(dtype), h,
                                    c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == nullptr, "fused_adam: CUDA launch failed: ", err);
}

}  // namespace ze

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zeroengine CUDA multi-tensor Adam/AdamW step";
  m.def("fused_adam", &ze::fused_adam, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw"));
}
