// cuda_utils.cuh -- helpers shared by the CUDA kernels: the current stream, launch checks, warp sums.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace minisgl::cuda {

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, kernel, " launch failed: ", cudaGetErrorString(err));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <typename T>
__device__ __forceinline__ float to_float(T x) {
  return static_cast<float>(x);
}

// page_table[row, pos] for an int32 or int64 table.
__device__ __forceinline__ int64_t slot_at(const void* pt, bool pt64, int64_t s0, int64_t s1, int64_t row,
                                           int64_t pos) {
  const int64_t off = row * s0 + pos * s1;
  return pt64 ? static_cast<const int64_t*>(pt)[off] : static_cast<const int32_t*>(pt)[off];
}

}  // namespace minisgl::cuda

// Run `__VA_ARGS__` (a lambda body using scalar_t) for the three cache dtypes the kernels support.
#define MINISGL_DISPATCH_FLOAT(dtype, name, ...)                                       \
  [&] {                                                                                \
    switch (dtype) {                                                                   \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }               \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }     \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }             \
      default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);                \
    }                                                                                  \
  }()
