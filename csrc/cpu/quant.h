// quant.h -- the entry points of quant.cpp (linears over GGUF-quantized and int8 weights), for bindings.cpp.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gemv.h"

namespace minisgl {
namespace cpu {

// Activations [M, K] quantized per block of 32 (quant.cpp): q8 in 64-byte aligned rows; per row and block of 32 its
// scale dx, dx * sum(q8) per block of 32 and per half of 16, and sum(q8) per block of 32. reset() sizes it; quantize_rows() fills rows
// [m0, m1) (any threads, disjoint rows).
struct QAct {
  int64_t M = 0, K = 0, Kp = 0;   // Kp: K rounded up to 64
  std::vector<int8_t> q8;        // [M, Kp] (+ 64 bytes of slack for alignment)
  std::vector<float> d32;        // [M, K/32]
  std::vector<float> s32;        // [M, K/32]
  std::vector<int32_t> i32;      // [M, K/32] sum(q8) itself (the signed formats' offset, taken off in integers)
  std::vector<float> s16;        // [M, K/16]
  std::vector<float> xf;         // [M, K] fp32: the portable path's input (decode.cpp fills it)
  std::vector<uint16_t> xpad;    // AMX: x as bf16 [ceil(M/16) * 16, K], zero rows past M (whole tiles to load)
  int64_t q8_off = 0;
  const int8_t* q(int64_t m) const { return q8.data() + q8_off + m * Kp; }
  void reset(int64_t M, int64_t K);
  void quantize_rows(const float* x, int64_t xs, int64_t m0, int64_t m1);
  void quantize_rows(const uint16_t* x_bf16, int64_t xs, int64_t m0, int64_t m1);
  void reset_packed(int64_t M, int64_t K);                                   // AMX: sizes xpad (zero padding)
  void pack_rows(const uint16_t* x_bf16, int64_t xs, int64_t m0, int64_t m1);  // AMX: rows [m0, m1) into xpad
};

// One linear over quantized parts (rows concatenated), cut into `nparts` ranges of rows for any threads to run.
struct QuantPlan {
  struct Part { const uint8_t* w; int64_t qtype, rows, rb, start; };
  std::vector<Part> parts;
  int64_t N = 0, K = 0, nparts = 1, per = 0;
  const float* bias = nullptr;   // fp32 [N] or null; must outlive the plan's runs
  bool q8 = true;                // the int8 kernel (AVX512-VNNI or AVX2); else the portable path
  bool amx = false;              // dequantize 32 weights x 16 rows into a bf16 tile, multiply on AMX (bf16 x)
};

// Which body of the int8 kernel runs here (quant.cpp): VNNI, AVX2, or none (the portable path).
enum class Q8Isa { none, avx2, vnni };
Q8Isa q8_isa_here();

// Whether the AMX kernel runs here (AMX-BF16, the tile state lent, no MINISGL_CPU_ISA cap).
bool quant_amx_here();

// Checked: every part's type holds rows of K weights and its tensor is uint8 [rows, row_bytes], rows % 16 == 0.
QuantPlan make_quant_plan(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& qtypes, int64_t K,
                          const float* bias, int64_t nparts);

// Part `part` of the plan: y[:, rows of the part] for the M rows of `a` (quantized from x); y [M, ys] as yf says.
// The portable path (no int8 kernel) reads xf, x as fp32 [M, K], instead of `a`.
void run_quant_part(const QuantPlan& p, const QAct& a, const float* xf, int64_t part, void* y, int64_t ys, YFormat yf);

}  // namespace cpu

// Bytes of one repacked row of K weights of type qtype (GGML's ids 2 3 8 12 13 14, or 100 for per-channel int8),
// -1 where that type cannot hold such rows.
int64_t quant_row_bytes(int64_t qtype, int64_t K);
// The body of quant_linear's int8 kernel here: "avx512-vnni", "avx2" (MINISGL_CPU_ISA=avx2 imitates it on a wider CPU),
// or "" where only the portable path runs.
std::string quant_q8dot_isa();
// The fp32 values of weight w (or of its rows `rows`), exactly as gguf-py dequantizes them.
at::Tensor quant_dequantize_cpu(const at::Tensor& w, int64_t qtype, int64_t K, const c10::optional<at::Tensor>& rows);
// y = x @ W^T (+ bias) in x's dtype, W the row-wise concatenation of `weights`, each of its own type; kernel: -1 the
// best of int8 (VNNI or AVX2) and portable here, 0 portable, 1 int8, 2 AMX (bf16 x).
at::Tensor quant_linear_cpu(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, const c10::optional<at::Tensor>& bias, int64_t kernel);

}  // namespace minisgl
