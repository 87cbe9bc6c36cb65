// quant.h -- the entry points of quant.cpp (linears over GGUF-quantized and int8 weights), for bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <vector>

namespace minisgl {

// Bytes of one repacked row of K weights of type qtype (GGML's ids 2 3 8 12 13 14, or 100 for per-channel int8),
// -1 where that type cannot hold such rows.
int64_t quant_row_bytes(int64_t qtype, int64_t K);
// Whether quant_linear runs its VNNI kernel here (AVX512-VNNI, no MINISGL_CPU_ISA cap below avx512).
bool quant_vnni_available();
// The fp32 values of weight w (or of its rows `rows`), exactly as gguf-py dequantizes them.
at::Tensor quant_dequantize_cpu(const at::Tensor& w, int64_t qtype, int64_t K, const c10::optional<at::Tensor>& rows);
// y = x @ W^T (+ bias) in x's dtype, W the row-wise concatenation of `weights`, each of its own type.
at::Tensor quant_linear_cpu(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, const c10::optional<at::Tensor>& bias, int64_t vnni);

}  // namespace minisgl
