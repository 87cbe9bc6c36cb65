// attention_plan.h -- CPU decode attention prepared once and run for one layer's caches at a time.
//
// decode_attention_cpu validates its arguments, splits the (request, KV head) pairs into tasks and allocates its
// buffers on every call. A decode step asks the same question of every layer (same queries buffer, same page
// table and lengths), so decode.cpp builds the plan once per step and runs it per layer: no allocation and no
// validation between the GEMVs, where the caches have just been flushed by streaming the weights.
#pragma once
#include <ATen/core/Tensor.h>

#include <memory>

namespace minisgl {
namespace cpu {

class DecodeAttentionPlan {
 public:
  // q: [B, Hq, D] (last dim contiguous) and out: contiguous [B, Hq, D], both fixed for the plan's runs; the
  // caches given here fix the layout (shape, dtype) that every run's caches must have. Checks everything.
  DecodeAttentionPlan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& page_table, const at::Tensor& table_idx, const at::Tensor& seq_lens,
                      double scale, int64_t sliding_window, const at::Tensor& out, int64_t threads);
  ~DecodeAttentionPlan();
  // out = attention of q over these caches; on torch's threads (parallel) or on the calling thread alone.
  void run(const at::Tensor& k_cache, const at::Tensor& v_cache, bool parallel);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cpu
}  // namespace minisgl
