// attention_plan.h -- CPU decode attention prepared once and run for one layer's caches at a time.
//
// decode_attention_cpu validates its arguments, splits the (request, KV head) pairs into tasks and allocates its
// buffers on every call. A decode step asks the same question of every layer (same queries buffer, same page
// table and lengths), so decode.cpp builds the plan once per step and runs it per layer: no allocation and no
// validation between the GEMVs, where the caches have just been flushed by streaming the weights.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <memory>

namespace minisgl {
namespace cpu {

// Runs fn(t) for the tasks the threads of a run take from `next`, `group` consecutive ones at a time, until none is left.
template <typename F>
inline void take_tasks(std::atomic<int64_t>& next, int64_t ntasks, int64_t group, F&& fn) {
  for (int64_t t0; (t0 = next.fetch_add(group, std::memory_order_relaxed)) < ntasks;)
    for (int64_t t = t0; t < std::min(ntasks, t0 + group); ++t) fn(t);
}

class DecodeAttentionPlan {
 public:
  // q: [B, Hq, D] (last dim contiguous) and out: contiguous [B, Hq, D], both fixed for the plan's runs; the
  // caches given here fix the layout (shape, dtype) that every run's caches must have. Checks everything.
  // threads: how many threads will share a run (long requests are split into more tasks to feed them).
  DecodeAttentionPlan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& page_table, const at::Tensor& table_idx, const at::Tensor& seq_lens,
                      double scale, int64_t sliding_window, const at::Tensor& out, int64_t threads);
  ~DecodeAttentionPlan();
  // out = attention of q over these caches; on torch's threads (parallel) or on the calling thread alone.
  void run(const at::Tensor& k_cache, const at::Tensor& v_cache, bool parallel);

  // The same in pieces, for threads the caller runs (decode.cpp's region): bind the caches (one thread), then
  // every task t once, on any threads (`thread`, below the plan's `threads`, picks the scratch; take_tasks hands them
  // out task_group() at a time), then, after all tasks, every split pair i once. Tasks are sorted longest first.
  void bind(const at::Tensor& k_cache, const at::Tensor& v_cache);
  int64_t num_tasks() const;
  int64_t task_group() const;   // tasks to take at a time: a request's KV heads, which read the same slots
  int64_t num_split_pairs() const;
  void run_task(int64_t t, int64_t thread);
  void finish_split(int64_t i, int64_t thread);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace cpu
}  // namespace minisgl
