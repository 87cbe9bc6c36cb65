// bindings.cpp -- the Python face of minisgl._C: one function per kernel, dispatched on the device of its
// tensors (CPU kernels in csrc/cpu, CUDA kernels in csrc/cuda when built with MINISGL_WITH_CUDA).
#include <torch/extension.h>

#include "common.h"
#include "ops.h"
#include "cpu/quant.h"

namespace minisgl {
namespace {

[[noreturn]] void no_cuda(const char* fn) {
  TORCH_CHECK(false, fn, ": got CUDA tensors but minisgl._C was built without CUDA; rebuild with "
              "`pip install --no-build-isolation -e .` where torch has CUDA");
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& out_loc, const at::Tensor& k,
              const at::Tensor& v) {
  check_store(k_cache, v_cache, out_loc, k, v);
  if (k_cache.is_cuda()) {
#ifdef MINISGL_WITH_CUDA
    return store_kv_cuda(k_cache, v_cache, out_loc, k, v);
#else
    no_cuda("store_kv");
#endif
  }
  store_kv_cpu(k_cache, v_cache, out_loc, k, v);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& table_idx, const at::Tensor& seq_lens,
                            double scale, int64_t sliding_window) {
  check_attention(q, k_cache, v_cache, page_table, table_idx, seq_lens, c10::nullopt, scale, sliding_window);
  if (q.is_cuda()) {
#ifdef MINISGL_WITH_CUDA
    return decode_attention_cuda(q, k_cache, v_cache, page_table, table_idx, seq_lens, scale, sliding_window);
#else
    no_cuda("decode_attention");
#endif
  }
  return decode_attention_cpu(q, k_cache, v_cache, page_table, table_idx, seq_lens, scale, sliding_window);
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& page_table, const at::Tensor& table_idx, const at::Tensor& seq_lens,
                            const at::Tensor& extend_lens, double scale, int64_t sliding_window) {
  check_attention(q, k_cache, v_cache, page_table, table_idx, seq_lens, extend_lens, scale, sliding_window);
  if (q.is_cuda()) {
#ifdef MINISGL_WITH_CUDA
    return extend_attention_cuda(q, k_cache, v_cache, page_table, table_idx, seq_lens, extend_lens, scale,
                                 sliding_window);
#else
    no_cuda("extend_attention");
#endif
  }
  return extend_attention_cpu(q, k_cache, v_cache, page_table, table_idx, seq_lens, extend_lens, scale,
                              sliding_window);
}

at::Tensor linear_gemv(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const std::string& isa) {
  TORCH_CHECK(!x.is_cuda() && !weight.is_cuda(), "linear_gemv: CPU only (use torch.nn.functional.linear on CUDA)");
  return linear_gemv_cpu(x, weight, bias, isa);
}

void fused_add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  fused_add_rms_norm_cpu(x, residual, weight, eps);
}

void rope_store_kv_(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& out_loc, int64_t num_q_heads,
                    int64_t num_kv_heads) {
  rope_store_kv_cpu(qkv, positions, cos, sin, k_cache, v_cache, out_loc, num_q_heads, num_kv_heads);
}

bool has_cuda() {
#ifdef MINISGL_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace minisgl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "minisgl native kernels: paged KV store, decode and extend attention";
  m.def("store_kv", &minisgl::store_kv, "k_cache[out_loc[i]] = k[i]; v_cache[out_loc[i]] = v[i] (in place)",
        py::arg("k_cache"), py::arg("v_cache"), py::arg("out_loc"), py::arg("k"), py::arg("v"));
  m.def("decode_attention", &minisgl::decode_attention, "paged attention, one query token per request",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("table_idx"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = -1);
  m.def("extend_attention", &minisgl::extend_attention, "causal paged attention over a cached prefix",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"), py::arg("table_idx"),
        py::arg("seq_lens"), py::arg("extend_lens"), py::arg("scale"), py::arg("sliding_window") = -1);
  m.def("linear_gemv", &minisgl::linear_gemv, "y = x @ weight.T (+ bias) for a few rows of x; weight bf16 [N, K]",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(), py::arg("isa") = "");
  m.def("linear_packed_available", &minisgl::linear_packed_available,
        "whether linear_packed runs here (a CPU with AVX2 and FMA, or AVX512-BF16)");
  m.def("linear_packed_isa", &minisgl::linear_packed_isa,
        "the body linear_packed runs here by default: avx512bf16 | avx512 | avx2 | none");
  m.def("pack_linear_weight", &minisgl::pack_linear_weight,
        "repack a bf16 weight [N, K] for linear_packed: [ceil(N/16), K/2, 16, 2], zero rows past N", py::arg("weight"));
  m.def("linear_packed", &minisgl::linear_packed,
        "y = x @ weight.T (+ bias) for a batch of bf16 rows, weight packed by pack_linear_weight; N: its rows",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("amx") = false,
        py::arg("fma") = false);
  m.def("linear_fma_available", &minisgl::linear_fma_available,
        "whether linear_packed(..., fma=True) runs here: fp32 FMAs on AVX-512 (MINISGL_CPU_ISA not capping it lower)");
  m.def("linear_amx_available", &minisgl::linear_amx_available,
        "whether linear_packed(..., amx=True) runs here: a CPU with AMX-BF16 whose OS lends this process the tile "
        "state, MINISGL_CPU_ISA not capping it");
  m.def("linear_isa", &minisgl::linear_isa, "the GEMV variant linear_gemv uses on this machine");
  m.def("rms_norm", &minisgl::rms_norm_cpu, "RMSNorm of each row of x (CPU): T(T(x * rsqrt(mean(x^2) + eps)) * weight)",
        py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm_", &minisgl::fused_add_rms_norm_,
        "in place (CPU): residual = x + residual; x = rms_norm(residual, weight, eps)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("silu_mul", &minisgl::silu_mul_cpu, "silu(gate) * up for gate_up = [gate | up] (CPU)", py::arg("gate_up"));
  m.def("argmax_rows", &minisgl::argmax_rows_cpu,
        "logits.max(-1).indices for fp32 [rows, n] logits: the first maximum, or the first NaN (CPU)", py::arg("logits"));
  m.def("silu_isa", &minisgl::silu_isa, "the vector width of the bf16 SiLU row on this machine: avx512 | avx2 | baseline");
  m.def("rope_store_kv_", &minisgl::rope_store_kv_,
        "rotate the q and k heads of qkv in place (neox rotary, cos/sin tables by position), then store k and v "
        "at out_loc (CPU)",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("out_loc"), py::arg("num_q_heads"), py::arg("num_kv_heads"));
  m.def("decode_layers", &minisgl::decode_layers_cpu,
        "all decoder layers of a bf16 decode step of up to 64 rows on the CPU (the loop of CausalLM._decode_layers, "
        "in C++, one parallel region; the GIL is released); weights: 10 per layer, projections plain or packed. "
        "Returns (x, residual), or (logits, residual) given final_norm and lm_head (vocab_size for a packed one); "
        "amx, fma: which of qkv, o, gate_up, down, lm_head run their packed weight on AMX, on AVX-512 FMAs; "
        "quant_weights, quant_types: each projection's quantized parts and their types (4 per layer, then the head; "
        "an empty list: the dense weight in weights), a quantized head given as an empty tensor with its vocab_size; "
        "quant_amx: which of them run the AMX kernel rather than VNNI",
        py::arg("x"), py::arg("weights"), py::arg("eps"), py::arg("k_caches"), py::arg("v_caches"), py::arg("cos"),
        py::arg("sin"), py::arg("positions"), py::arg("out_loc"), py::arg("page_table"), py::arg("table_idx"),
        py::arg("seq_lens"), py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("scale"),
        py::arg("sliding_windows"), py::arg("final_norm") = py::none(), py::arg("lm_head") = py::none(),
        py::arg("vocab_size") = -1, py::arg("amx") = std::vector<bool>{}, py::arg("fma") = std::vector<bool>{},
        py::arg("quant_weights") = std::vector<std::vector<at::Tensor>>{},
        py::arg("quant_types") = std::vector<std::vector<int64_t>>{}, py::arg("quant_amx") = std::vector<bool>{},
        py::call_guard<py::gil_scoped_release>());
  py::class_<minisgl::DecodeStep>(m, "DecodeStep",
        "decode_layers bound to what stays from step to step (weights, model shape, rows: the arguments of decode_layers "
        "but x and the per-step tensors, head_dim given), checked and planned once; call it with x, k_caches, v_caches, "
        "cos, sin, positions, out_loc, page_table, table_idx, seq_lens for decode_layers' result")
      .def(py::init<int64_t, const std::vector<c10::optional<at::Tensor>>&, double, int64_t, int64_t, int64_t, double,
                    const std::vector<int64_t>&, const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                    int64_t, const std::vector<bool>&, const std::vector<bool>&,
                    const std::vector<std::vector<at::Tensor>>&, const std::vector<std::vector<int64_t>>&,
                    const std::vector<bool>&>(),
           py::arg("rows"), py::arg("weights"), py::arg("eps"), py::arg("head_dim"), py::arg("num_q_heads"),
           py::arg("num_kv_heads"), py::arg("scale"), py::arg("sliding_windows"), py::arg("final_norm") = py::none(),
           py::arg("lm_head") = py::none(), py::arg("vocab_size") = -1, py::arg("amx") = std::vector<bool>{},
           py::arg("fma") = std::vector<bool>{}, py::arg("quant_weights") = std::vector<std::vector<at::Tensor>>{},
           py::arg("quant_types") = std::vector<std::vector<int64_t>>{}, py::arg("quant_amx") = std::vector<bool>{})
      .def("__call__", &minisgl::DecodeStep::run, py::arg("x"), py::arg("k_caches"), py::arg("v_caches"),
           py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("out_loc"), py::arg("page_table"),
           py::arg("table_idx"), py::arg("seq_lens"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rows", &minisgl::DecodeStep::rows);
  m.def("quant_row_bytes", &minisgl::quant_row_bytes,
        "bytes of one repacked row of K weights of a quantized type (GGML ids; 100: per-channel int8), -1 if none",
        py::arg("qtype"), py::arg("k"));
  m.def("quant_q8dot_isa", &minisgl::quant_q8dot_isa,
        "the body of quant_linear's int8 kernel here: 'avx512-vnni', 'avx2' (MINISGL_CPU_ISA=avx2 caps it), '' (portable)");
  m.def("quant_amx_available", &minisgl::cpu::quant_amx_here,
        "whether quant_linear(..., kernel=2) runs here: AMX-BF16 with the tile state lent, MINISGL_CPU_ISA not capping it");
  m.def("quant_dequantize", &minisgl::quant_dequantize_cpu,
        "fp32 [rows, K] of a repacked quantized weight (all rows, or those listed), as gguf-py dequantizes",
        py::arg("weight"), py::arg("qtype"), py::arg("k"), py::arg("rows") = py::none());
  m.def("quant_linear", &minisgl::quant_linear_cpu,
        "y = x @ W.T (+ bias) over quantized weight parts (rows concatenated), activations quantized per 32; "
        "kernel: -1 best here of VNNI and portable, 0 portable, 1 VNNI, 2 AMX (bf16 x: 16 x 32 weight tiles dequantized, "
        "then tdpbf16ps)",
        py::arg("x"), py::arg("weights"), py::arg("qtypes"), py::arg("bias") = py::none(), py::arg("kernel") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("has_cuda", &minisgl::has_cuda, "whether the CUDA kernels were compiled in");
  m.def("cpu_isa", &minisgl::cpu_isa, "the instruction set the CPU kernels use on this machine");
  m.def("attention_bodies", &minisgl::attention_bodies, "the CPU attention bodies that run here for a case, the flags' choice first",
        py::arg("kind"), py::arg("dtype"), py::arg("head_dim"), py::arg("group"));
  m.def("use_attention_body", &minisgl::use_attention_body, "make `name` the body every CPU attention call of the case runs",
        py::arg("kind"), py::arg("dtype"), py::arg("head_dim"), py::arg("group"), py::arg("name"));
  m.def("attention_body", &minisgl::attention_body, "the CPU attention body a case runs",
        py::arg("kind"), py::arg("dtype"), py::arg("head_dim"), py::arg("group"));
}
