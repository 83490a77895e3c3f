// Per-step Adam constants shared by the CPU and CUDA kernels.
//
// Plain C++ with no torch or CUDA includes, so nvcc can compile the device code
// without torch headers (the CPU-only torch wheel ships no CUDA headers).
#pragma once

#include <cmath>
#include <cstdint>

namespace ze {

struct AdamHyper {
  float beta1;
  float beta2;
  float eps;
  float weight_decay;   // L2 coefficient added to the gradient (Adam mode)
  float decay_factor;   // 1 - lr * weight_decay, applied to the param (AdamW mode)
  float step_size;      // lr / (1 - beta1^step)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^step)
  bool adamw;
};

// The bias corrections are computed in double and rounded once, as
// torch.optim.Adam does in Python, so both sides start from the same floats.
inline AdamHyper make_adam_hyper(int64_t step, double lr, double beta1, double beta2,
                                 double eps, double weight_decay, bool adamw) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamHyper h;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.eps = static_cast<float>(eps);
  h.weight_decay = adamw ? 0.0f : static_cast<float>(weight_decay);
  h.decay_factor = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  h.step_size = static_cast<float>(lr / bias_correction1);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  h.adamw = adamw;
  return h;
}

}  // namespace ze
