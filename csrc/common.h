// common.h -- boundary checks shared by the CPU and CUDA paged-attention kernels.
//
// Layouts (one transformer layer):
//   k_cache, v_cache : [num_slots, Hkv, D]  fp32 | bf16 | fp16, last dim contiguous; slot = page * page_size + offset
//   page_table       : [rows, max_seq_len]  int32 | int64, TOKEN-level: page_table[row, pos] = slot
//   table_idx        : [B] int32 | int64, the page-table row of each request
//   seq_lens         : [B] int32 | int64, tokens with K/V in the cache (prefix + this forward)
//   extend_lens      : [B] int32 | int64, query tokens of each request in this forward (extend only)
//   q                : [N, Hq, D] same dtype as the caches, last dim contiguous; Hq % Hkv == 0
//   out              : [N, Hq, D] contiguous, dtype of q
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

namespace minisgl {

inline void check_index_vector(const at::Tensor& t, const char* name, int64_t batch) {
  TORCH_CHECK(t.dim() == 1, name, " must be 1-D, got ", t.dim(), " dims");
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, name, " must be int32 or int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.size(0) == batch, name, " has ", t.size(0), " entries but the batch has ", batch, " requests");
}

inline void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 3, "k_cache must be [num_slots, Hkv, D], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(), " != k_cache shape ",
              k_cache.sizes());
  auto dt = k_cache.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
              "k_cache must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(v_cache.scalar_type() == dt, "v_cache dtype ", v_cache.scalar_type(), " != k_cache dtype ", dt);
  TORCH_CHECK(k_cache.stride(2) == 1, "k_cache must be contiguous in its last (head_dim) dimension");
  TORCH_CHECK(v_cache.stride(2) == 1, "v_cache must be contiguous in its last (head_dim) dimension");
  TORCH_CHECK(v_cache.device() == k_cache.device(), "v_cache is on ", v_cache.device(), " but k_cache is on ",
              k_cache.device());
}

// Checks for decode (extend_lens undefined) and extend attention.
inline void check_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& table_idx, const at::Tensor& seq_lens,
                            const c10::optional<at::Tensor>& extend_lens, double scale, int64_t sliding_window) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3, "q must be [tokens, Hq, D], got ", q.sizes());
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q dtype ", q.scalar_type(), " != k_cache dtype ",
              k_cache.scalar_type());
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q head_dim ", q.size(2), " != k_cache head_dim ", k_cache.size(2));
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "q heads (", q.size(1), ") must be a multiple of kv heads (",
              k_cache.size(1), ")");
  TORCH_CHECK(page_table.dim() == 2, "page_table must be 2-D [rows, max_seq_len], got ", page_table.sizes());
  TORCH_CHECK(page_table.scalar_type() == at::kInt || page_table.scalar_type() == at::kLong,
              "page_table must be int32 or int64, got ", page_table.scalar_type());
  TORCH_CHECK(table_idx.dim() == 1, "table_idx must be 1-D, got ", table_idx.sizes());
  const int64_t batch = table_idx.size(0);
  check_index_vector(table_idx, "table_idx", batch);
  check_index_vector(seq_lens, "seq_lens", batch);
  if (extend_lens.has_value()) {
    check_index_vector(*extend_lens, "extend_lens", batch);
  } else {
    TORCH_CHECK(q.size(0) == batch, "decode q has ", q.size(0), " rows but the batch has ", batch, " requests");
  }
  for (const at::Tensor* t : {&k_cache, &page_table, &table_idx, &seq_lens}) {
    TORCH_CHECK(t->device() == q.device(), "all inputs must be on q's device ", q.device(), ", got ", t->device());
  }
  if (extend_lens.has_value())
    TORCH_CHECK(extend_lens->device() == q.device(), "extend_lens is on ", extend_lens->device(), " but q is on ",
                q.device());
  TORCH_CHECK(scale > 0, "scale must be positive, got ", scale);
  TORCH_CHECK(sliding_window == -1 || sliding_window > 0, "sliding_window must be -1 (off) or positive, got ",
              sliding_window);
}

inline void check_store(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& out_loc,
                        const at::Tensor& k, const at::Tensor& v) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(out_loc.dim() == 1, "out_loc must be 1-D, got ", out_loc.sizes());
  TORCH_CHECK(out_loc.scalar_type() == at::kInt || out_loc.scalar_type() == at::kLong,
              "out_loc must be int32 or int64, got ", out_loc.scalar_type());
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == out_loc.size(0) && t->size(1) == k_cache.size(1) &&
                    t->size(2) == k_cache.size(2),
                name, " must be [N, Hkv, D] = [", out_loc.size(0), ", ", k_cache.size(1), ", ", k_cache.size(2),
                "], got ", t->sizes());
    auto dt = t->scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, name, " must be a float tensor, got ",
                dt);
    TORCH_CHECK(t->device() == k_cache.device(), name, " is on ", t->device(), " but k_cache is on ",
                k_cache.device());
  }
  TORCH_CHECK(out_loc.device() == k_cache.device(), "out_loc is on ", out_loc.device(), " but k_cache is on ",
              k_cache.device());
}

}  // namespace minisgl
