// store_kv.cpp -- write a batch's new K/V rows into the paged pool (CPU).
//   k_cache, v_cache : [num_slots, Hkv, D] (last dim contiguous), written in place
//   out_loc          : [N] int32 | int64, slot of each new token
//   k, v             : [N, Hkv, D], any strides and any float dtype (cast to the cache dtype)
// Each (token, head) row is an independent copy of D elements, so the work is split over tokens.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "../common.h"
#include "../ops.h"

namespace minisgl {

template <typename T, typename Idx>
static void store_rows(at::Tensor& cache, const at::Tensor& src, const Idx* loc, int64_t n) {
  const int64_t H = cache.size(1), D = cache.size(2), cs0 = cache.stride(0), cs1 = cache.stride(1);
  const int64_t ss0 = src.stride(0), ss1 = src.stride(1);
  T* dst = cache.data_ptr<T>();
  const T* s = src.data_ptr<T>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = dst + static_cast<int64_t>(loc[i]) * cs0;
      for (int64_t h = 0; h < H; ++h) std::memcpy(row + h * cs1, s + i * ss0 + h * ss1, sizeof(T) * D);
    }
  });
}

void store_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, const at::Tensor& k,
                  const at::Tensor& v) {
  const int64_t n = out_loc.size(0);
  if (n == 0) return;
  auto loc = out_loc.contiguous();
  const int64_t num_slots = k_cache.size(0);
  {  // an out-of-range slot would be a silent heap write: check once, it costs O(N)
    auto [lo, hi] = at::aminmax(loc);
    TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() < num_slots, "out_loc values must lie in [0, ",
                num_slots, "), got [", lo.item<int64_t>(), ", ", hi.item<int64_t>(), "]");
  }
  // rows must be contiguous in D and in the cache dtype; a cast or copy here is O(N) and rare
  auto prep = [&](const at::Tensor& t) {
    auto r = t.scalar_type() == k_cache.scalar_type() ? t : t.to(k_cache.scalar_type());
    return r.stride(2) == 1 ? r : r.contiguous();
  };
  auto kk = prep(k), vv = prep(v);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "store_kv_cpu", [&] {
    if (loc.scalar_type() == at::kInt) {
      store_rows<scalar_t>(k_cache, kk, loc.data_ptr<int32_t>(), n);
      store_rows<scalar_t>(v_cache, vv, loc.data_ptr<int32_t>(), n);
    } else {
      store_rows<scalar_t>(k_cache, kk, loc.data_ptr<int64_t>(), n);
      store_rows<scalar_t>(v_cache, vv, loc.data_ptr<int64_t>(), n);
    }
  });
}

}  // namespace minisgl
