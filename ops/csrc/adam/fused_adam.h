// Interface between the CUDA multi-tensor Adam kernel (fused_adam.cu) and its
// torch binding (fused_adam.cpp). Raw pointers only: the .cu file includes no
// torch header, so it compiles with plain nvcc, with or without a CUDA torch.
#pragma once

#include <cstdint>

#include "adam_hyper.h"

namespace ze {

enum class ParamType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// One parameter: param and grad are of the launch's ParamType, the Adam
// moments are always fp32 (16-bit moments lose small updates).
struct AdamTensorPtrs {
  void* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  int64_t numel;
};

// Enqueues the update of all `count` tensors on `stream` (a cudaStream_t).
// Returns nullptr on success, else the CUDA error string.
const char* fused_adam_cuda(const AdamTensorPtrs* tensors, int64_t count, ParamType type,
                            const AdamHyper& hyper, void* stream);

}  // namespace ze
