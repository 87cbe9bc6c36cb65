// ops.h -- the kernel entry points of minisgl._C (layouts: see common.h).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace minisgl {

std::string cpu_isa();  // the attention kernels' instruction set, picked at run time: avx512bf16 | avx512 | avx2 | baseline
// The CPU attention bodies that run here for a case (kind "decode" | "extend", dtype "float32" | "bfloat16" |
// "float16", head_dim, group = query heads per KV head), the flags' choice first; the one every call of the case
// runs (name "" goes back to the first); and the one in use.
std::vector<std::string> attention_bodies(const std::string& kind, const std::string& dtype, int64_t head_dim, int64_t group);
void use_attention_body(const std::string& kind, const std::string& dtype, int64_t head_dim, int64_t group, const std::string& name);
std::string attention_body(const std::string& kind, const std::string& dtype, int64_t head_dim, int64_t group);

void store_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, const at::Tensor& k,
                  const at::Tensor& v);
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& page_table, const at::Tensor& table_idx,
                                const at::Tensor& seq_lens, double scale, int64_t sliding_window);
at::Tensor extend_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& page_table, const at::Tensor& table_idx,
                                const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale,
                                int64_t sliding_window);

// y[M, N] = x[M, K] @ weight[N, K]^T (+ bias) for small M (decode): weight bf16, x bf16 | fp32, fp32
// accumulation, y in x's dtype. isa: "" (the best this machine has) or one of linear_isa()'s names at or
// below it, to test the narrower variants.
at::Tensor linear_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const std::string& isa);
std::string linear_isa();  // the GEMV variant picked at run time: avx512bf16 | avx512 | avx2 | baseline

// Batch bf16 linear over a repacked weight (csrc/cpu/gemm_bf16.cpp; AVX512-BF16 dot products, else AVX2 + FMA on
// W widened in registers): pack once with pack_linear_weight ([N, K] -> [ceil(N/16), K/2, 16, 2]), then
// y[M, N] = x @ W^T (+ bias), bf16.
bool linear_packed_available();
std::string linear_packed_isa();  // the body linear_packed runs here by default: avx512bf16 | avx512 | avx2 | none
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                         bool amx = false,   // amx: the same product on AMX tiles (gemm_amx.cpp)
                         bool fma = false);  // fma: on fp32 FMAs (AVX-512) where the default is AVX512-BF16's
bool linear_amx_available();  // whether linear_packed(..., amx=true) runs here
bool linear_fma_available();  // whether linear_packed(..., fma=true) runs here: an AVX-512 CPU, no cap below it

// Fused element-wise ops of a decoder layer (csrc/cpu/fused.cpp): x, residual, gate_up, qkv are [rows, features]
// with a contiguous last dimension; fp32 math, rounded to the tensor dtype where the torch reference rounds.
at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
at::Tensor silu_mul_cpu(const at::Tensor& gate_up);
at::Tensor argmax_rows_cpu(const at::Tensor& logits);  // logits.max(-1).indices for fp32 [rows, n]
std::string silu_isa();  // the bf16 SiLU row the fused kernels picked: avx512 | avx2 | baseline
void silu_mul_out_cpu(const at::Tensor& gate_up, at::Tensor& out);  // into out [rows, features / 2]
void rope_store_kv_cpu(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, int64_t num_q_heads,
                       int64_t num_kv_heads);

// All decoder layers of a bf16 decode step of up to 64 rows (csrc/cpu/decode.cpp): the loop of
// CausalLM._decode_layers in C++ and one parallel region, calling the kernels above; weights are 10 per layer,
// projections plain or packed (see decode.cpp). Returns (x, residual), or (logits, residual) when final_norm and
// lm_head are given (vocab_size: the rows of a packed lm_head).
// The same step bound once to what stays from step to step: the weights (and their plans), the model's shape and
// the number of rows; run() takes what changes (x, the caches, the positions and the batch's lengths). Building it
// checks and plans everything decode_layers_cpu would; a run checks only its own arguments.
class DecodeStep {
 public:
  DecodeStep(int64_t rows, const std::vector<c10::optional<at::Tensor>>& weights, double eps, int64_t head_dim,
             int64_t num_q_heads, int64_t num_kv_heads, double scale, const std::vector<int64_t>& sliding_windows,
             const c10::optional<at::Tensor>& final_norm, const c10::optional<at::Tensor>& lm_head, int64_t vocab_size,
             const std::vector<bool>& amx, const std::vector<bool>& fma,
             const std::vector<std::vector<at::Tensor>>& quant_weights = {},
             const std::vector<std::vector<int64_t>>& quant_types = {}, const std::vector<bool>& quant_amx = {});
  ~DecodeStep();
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x, const std::vector<at::Tensor>& k_caches,
                                         const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                                         const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& out_loc,
                                         const at::Tensor& page_table, const at::Tensor& table_idx,
                                         const at::Tensor& seq_lens);
  int64_t rows() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

std::tuple<at::Tensor, at::Tensor> decode_layers_cpu(
    const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& weights, double eps,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& out_loc, const at::Tensor& page_table,
    const at::Tensor& table_idx, const at::Tensor& seq_lens, int64_t num_q_heads, int64_t num_kv_heads,
    double scale, const std::vector<int64_t>& sliding_windows, const c10::optional<at::Tensor>& final_norm,
    const c10::optional<at::Tensor>& lm_head, int64_t vocab_size, const std::vector<bool>& amx,
    const std::vector<bool>& fma, const std::vector<std::vector<at::Tensor>>& quant_weights = {},
    const std::vector<std::vector<int64_t>>& quant_types = {}, const std::vector<bool>& quant_amx = {});

#ifdef MINISGL_WITH_CUDA
void store_kv_cuda(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, const at::Tensor& k,
                   const at::Tensor& v);
at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& page_table, const at::Tensor& table_idx,
                                 const at::Tensor& seq_lens, double scale, int64_t sliding_window);
at::Tensor extend_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& page_table, const at::Tensor& table_idx,
                                 const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale,
                                 int64_t sliding_window);
#endif

}  // namespace minisgl
