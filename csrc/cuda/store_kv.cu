// store_kv.cu -- write a batch's new K/V rows into the paged pool (CUDA).
//   k_cache, v_cache : [num_slots, Hkv, D] (last dim contiguous), written in place
//   out_loc          : [N] int32 | int64, slot of each new token
//   k, v             : [N, Hkv, D], any strides; cast to the cache dtype
// One block per token; its threads copy the Hkv * D elements of K and of V.
#include "../common.h"
#include "../ops.h"
#include "cuda_utils.cuh"

namespace minisgl {
namespace cuda {
namespace {

template <typename T, typename Idx>
__global__ void store_kv_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache, const Idx* __restrict__ loc,
                                const T* __restrict__ k, const T* __restrict__ v, int64_t H, int64_t D,
                                int64_t kc_s0, int64_t kc_s1, int64_t vc_s0, int64_t vc_s1, int64_t k_s0,
                                int64_t k_s1, int64_t v_s0, int64_t v_s1) {
  const int64_t i = blockIdx.x;
  const int64_t slot = static_cast<int64_t>(loc[i]);
  for (int64_t e = threadIdx.x; e < H * D; e += blockDim.x) {
    const int64_t h = e / D, d = e % D;
    k_cache[slot * kc_s0 + h * kc_s1 + d] = k[i * k_s0 + h * k_s1 + d];
    v_cache[slot * vc_s0 + h * vc_s1 + d] = v[i * v_s0 + h * v_s1 + d];
  }
}

}  // namespace
}  // namespace cuda

void store_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, const at::Tensor& k_in,
                   const at::Tensor& v_in) {
  const int64_t n = out_loc.size(0);
  if (n == 0) return;
  auto prep = [&](const at::Tensor& t) {
    auto r = t.scalar_type() == k_cache.scalar_type() ? t : t.to(k_cache.scalar_type());
    return r.stride(2) == 1 ? r : r.contiguous();
  };
  auto k = prep(k_in), v = prep(v_in);
  const int64_t H = k_cache.size(1), D = k_cache.size(2);
  const int threads = static_cast<int>(std::min<int64_t>(256, ((H * D + 31) / 32) * 32));
  auto stream = cuda::current_stream();
  MINISGL_DISPATCH_FLOAT(k_cache.scalar_type(), "store_kv_cuda", [&] {
    auto launch = [&](auto* loc) {
      cuda::store_kv_kernel<scalar_t><<<n, threads, 0, stream>>>(
          k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), loc, k.data_ptr<scalar_t>(),
          v.data_ptr<scalar_t>(), H, D, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
          k.stride(0), k.stride(1), v.stride(0), v.stride(1));
    };
    if (out_loc.scalar_type() == at::kInt)
      launch(out_loc.data_ptr<int32_t>());
    else
      launch(out_loc.data_ptr<int64_t>());
  });
  cuda::check_launch("store_kv_kernel");
}

}  // namespace minisgl
