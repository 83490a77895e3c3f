// Multi-tensor Adam / AdamW for CUDA: one launch updates many tensors.
//
// An optimizer step over a model is hundreds of small tensors; a kernel per
// tensor would be launch-bound. Instead the host packs up to kMaxTensors
// tensors' pointers and up to kMaxBlocks (tensor, chunk) pairs into one struct
// passed by value as the kernel argument, and each thread block updates one
// kChunk-element chunk of one tensor. Long tensors span several launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fused_adam.h"

namespace ze {
namespace {

// Kernel arguments are limited to 4 KiB; these bounds fit four pointer lists,
// the sizes and the block table in that budget (checked below).
constexpr int kMaxTensors = 36;
constexpr int kMaxBlocks = 320;
constexpr int kChunk = 65536;
constexpr int kThreads = 512;

struct ChunkTable {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  int64_t numel[kMaxTensors];
  unsigned char tensor_of_block[kMaxBlocks];
  int chunk_of_block[kMaxBlocks];
};
static_assert(sizeof(ChunkTable) + sizeof(AdamHyper) <= 4096,
              "kernel arguments must fit in 4 KiB");
static_assert(kMaxTensors <= 256, "tensor_of_block is one byte");

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

__device__ __forceinline__ void from_float(float x, float* out) { *out = x; }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16* out) {
  *out = __float2bfloat16_rn(x);
}
__device__ __forceinline__ void from_float(float x, __half* out) { *out = __float2half_rn(x); }

// T is the param and grad type; the math runs in fp32 (the same formulas as
// the CPU kernel, see cpu_adam.cpp).
template <typename T>
__global__ void __launch_bounds__(kThreads) adam_kernel(ChunkTable table, AdamHyper h) {
  const int t = table.tensor_of_block[blockIdx.x];
  const int64_t begin = static_cast<int64_t>(table.chunk_of_block[blockIdx.x]) * kChunk;
  const int64_t end = min(table.numel[t], begin + kChunk);
  T* param = static_cast<T*>(table.param[t]);
  const T* grad = static_cast<const T*>(table.grad[t]);
  float* exp_avg = table.exp_avg[t];
  float* exp_avg_sq = table.exp_avg_sq[t];

  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    float p = to_float(param[i]);
    float g = to_float(grad[i]);
    if (h.weight_decay != 0.0f) g += h.weight_decay * p;  // Adam (L2; zero in AdamW mode): 0 * inf is NaN
    p *= h.decay_factor;      // AdamW (decoupled); one in Adam mode
    const float m = h.beta1 * exp_avg[i] + (1.0f - h.beta1) * g;
    const float v = h.beta2 * exp_avg_sq[i] + (1.0f - h.beta2) * g * g;
    const float denom = sqrtf(v) * h.inv_bc2_sqrt + h.eps;
    p -= h.step_size * (m / denom);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    from_float(p, &param[i]);
  }
}

template <typename T>
cudaError_t launch_all(const AdamTensorPtrs* tensors, int64_t count, const AdamHyper& h,
                       cudaStream_t stream) {
  ChunkTable table;
  int n_tensors = 0;
  int n_blocks = 0;
  for (int64_t i = 0; i < count; ++i) {
    const AdamTensorPtrs& src = tensors[i];
    if (src.numel == 0) continue;
    table.param[n_tensors] = src.param;
    table.grad[n_tensors] = src.grad;
    table.exp_avg[n_tensors] = src.exp_avg;
    table.exp_avg_sq[n_tensors] = src.exp_avg_sq;
    table.numel[n_tensors] = src.numel;
    ++n_tensors;
    const int64_t chunks = (src.numel + kChunk - 1) / kChunk;
    for (int64_t c = 0; c < chunks; ++c) {
      table.tensor_of_block[n_blocks] = static_cast<unsigned char>(n_tensors - 1);
      table.chunk_of_block[n_blocks] = static_cast<int>(c);
      ++n_blocks;
      const bool last_chunk = c == chunks - 1;
      if (n_blocks < kMaxBlocks && !(last_chunk && n_tensors == kMaxTensors)) continue;
      // The table is full: launch it and start a new one. A tensor cut mid-way
      // moves to slot 0 so its remaining chunks go into the next launch.
      adam_kernel<T><<<n_blocks, kThreads, 0, stream>>>(table, h);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      n_blocks = 0;
      if (last_chunk) {
        n_tensors = 0;
      } else {
        table.param[0] = table.param[n_tensors - 1];
        table.grad[0] = table.grad[n_tensors - 1];
        table.exp_avg[0] = table.exp_avg[n_tensors - 1];
        table.exp_avg_sq[0] = table.exp_avg_sq[n_tensors - 1];
        table.numel[0] = table.numel[n_tensors - 1];
        n_tensors = 1;
      }
    }
  }
  if (n_blocks > 0) adam_kernel<T><<<n_blocks, kThreads, 0, stream>>>(table, h);
  return cudaGetLastError();
}

}  // namespace

const char* fused_adam_cuda(const AdamTensorPtrs* tensors, int64_t count, ParamType type,
                            const AdamHyper& hyper, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaErrorInvalidValue;
  switch (type) {
    case ParamType::kFloat32: err = launch_all<float>(tensors, count, hyper, s); break;
    case ParamType::kBFloat16: err = launch_all<__nv_bfloat16>(tensors, count, hyper, s); break;
    case ParamType::kFloat16: err = launch_all<__half>(tensors, count, hyper, s); break;
  }
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace ze
