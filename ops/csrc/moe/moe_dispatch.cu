// Token permutation for Mixture-of-Experts on CUDA (see moe_dispatch.h).
//
// One thread block per output row (gather) or per token (combine and its
// backward), threads striding over the hidden dimension so loads coalesce.
// The gather copies raw 16-, 8-, 4- or 2-byte words, whatever the dtype;
// combine and its backward accumulate in fp32. The index arrays are built by
// the caller and are in range; an out-of-range row is skipped (gather writes
// zeros) rather than read, so a bad index cannot fault the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "moe_dispatch.h"

namespace ze {
namespace moe {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

template <typename Word>
__global__ void __launch_bounds__(kThreads)
gather_kernel(const Word* x, const int64_t* index, Word* out, int64_t n_out, int64_t n_in, int64_t words) {
  for (int64_t i = blockIdx.x; i < n_out; i += gridDim.x) {
    const int64_t r = index[i];
    const bool ok = r >= 0 && r < n_in;
    Word* dst = out + i * words;
    const Word* src = x + (ok ? r : 0) * words;
    for (int64_t c = threadIdx.x; c < words; c += blockDim.x) {
      if (ok) {
        dst[c] = src[c];
      } else {
        dst[c] = Word{};
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
combine_kernel(const T* y, const int64_t* rows, const float* w, T* out, int64_t tokens, int64_t k, int64_t n_rows,
               int64_t d) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      float acc = 0.f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = rows[t * k + j];
        if (r < 0 || r >= n_rows) continue;
        acc += (w ? w[t * k + j] : 1.f) * to_float(y[r * d + c]);
      }
      out[t * d + c] = from_float<T>(acc);
    }
  }
}

// Sum of `v` over the block; the result is valid in thread 0.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = 0.f;
  if (warp == 0) {
    v = lane < (blockDim.x >> 5) ? scratch[lane] : 0.f;
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  __syncthreads();  // scratch is reused by the next call
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
combine_backward_kernel(const T* g, const T* y, const int64_t* rows, const float* w, T* grad_y, float* grad_w,
                        int64_t tokens, int64_t k, int64_t n_rows, int64_t d) {
  __shared__ float scratch[kThreads / 32];
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = rows[t * k + j];  // the same for the whole block: branches stay uniform
      if (r < 0 || r >= n_rows) {
        if (grad_w != nullptr && threadIdx.x == 0) grad_w[t * k + j] = 0.f;
        continue;
      }
      const float wj = w ? w[t * k + j] : 1.f;
      float partial = 0.f;
      for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
        const float gv = to_float(g[t * d + c]);
        if (grad_y != nullptr) grad_y[r * d + c] = from_float<T>(wj * gv);
        if (grad_w != nullptr) partial += gv * to_float(y[r * d + c]);
      }
      if (grad_w != nullptr) {
        const float total = block_sum(partial, scratch);
        if (threadIdx.x == 0) grad_w[t * k + j] = total;
      }
    }
  }
}

int grid_for(int64_t n) { return static_cast<int>(n < kMaxBlocks ? (n > 0 ? n : 1) : kMaxBlocks); }

template <typename Word>
void launch_gather(const void* x, const int64_t* index, void* out, int64_t n_out, int64_t n_in, int64_t row_bytes,
                   cudaStream_t stream) {
  gather_kernel<Word><<<grid_for(n_out), kThreads, 0, stream>>>(
      static_cast<const Word*>(x), index, static_cast<Word*>(out), n_out, n_in,
      row_bytes / static_cast<int64_t>(sizeof(Word)));
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

size_t elem_size(DType type) { return type == DType::kFloat32 ? 4 : 2; }

const char* last_error() {
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

const char* gather_rows_cuda(const void* x, const int64_t* index, void* out, int64_t n_out, int64_t n_in,
                             int64_t dim, DType type, void* stream) {
  if (n_out == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t row_bytes = dim * static_cast<int64_t>(elem_size(type));
  // The widest word that divides a row and both base addresses.
  if (row_bytes % 16 == 0 && aligned(x, 16) && aligned(out, 16)) {
    launch_gather<int4>(x, index, out, n_out, n_in, row_bytes, s);
  } else if (row_bytes % 8 == 0 && aligned(x, 8) && aligned(out, 8)) {
    launch_gather<int2>(x, index, out, n_out, n_in, row_bytes, s);
  } else if (row_bytes % 4 == 0 && aligned(x, 4) && aligned(out, 4)) {
    launch_gather<int>(x, index, out, n_out, n_in, row_bytes, s);
  } else {
    launch_gather<short>(x, index, out, n_out, n_in, row_bytes, s);
  }
  return last_error();
}

const char* combine_rows_cuda(const void* y, const int64_t* rows, const float* w, void* out, int64_t tokens,
                              int64_t k, int64_t n_rows, int64_t dim, DType type, void* stream) {
  if (tokens == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(tokens);
  switch (type) {
    case DType::kFloat32:
      combine_kernel<float><<<grid, kThreads, 0, s>>>(static_cast<const float*>(y), rows, w,
                                                     static_cast<float*>(out), tokens, k, n_rows, dim);
      break;
    case DType::kBFloat16:
      combine_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(y), rows, w,
                                                             static_cast<__nv_bfloat16*>(out), tokens, k, n_rows,
                                                             dim);
      break;
    case DType::kFloat16:
      combine_kernel<__half><<<grid, kThreads, 0, s>>>(static_cast<const __half*>(y), rows, w,
                                                      static_cast<__half*>(out), tokens, k, n_rows, dim);
      break;
  }
  return last_error();
}

const char* combine_rows_backward_cuda(const void* g, const void* y, const int64_t* rows, const float* w,
                                       void* grad_y, float* grad_w, int64_t tokens, int64_t k, int64_t n_rows,
                                       int64_t dim, DType type, void* stream) {
  if (tokens == 0) return nullptr;
  auto s = static_cast<cudaStream_t>(stream);
  const int grid = grid_for(tokens);
  switch (type) {
    case DType::kFloat32:
      combine_backward_kernel<float><<<grid, kThreads, 0, s>>>(
          static_cast<const float*>(g), static_cast<const float*>(y), rows, w, static_cast<float*>(grad_y), grad_w,
          tokens, k, n_rows, dim);
      break;
    case DType::kBFloat16:
      combine_backward_kernel<__nv_bfloat16><<<grid, kThreads, 0, s>>>(
          static_cast<const __nv_bfloat16*>(g), static_cast<const __nv_bfloat16*>(y), rows, w,
          static_cast<__nv_bfloat16*>(grad_y), grad_w, tokens, k, n_rows, dim);
      break;
    case DType::kFloat16:
      combine_backward_kernel<__half><<<grid, kThreads, 0, s>>>(
          static_cast<const __half*>(g), static_cast<const __half*>(y), rows, w, static_cast<__half*>(grad_y),
          grad_w, tokens, k, n_rows, dim);
      break;
  }
  return last_error();
}

}  // namespace moe
}  // namespace ze
