// gemv.h -- the bf16 GEMV of linear.cpp as a plan that any threads can run part by part.
//
// linear_gemv runs the parts of a plan with at::parallel_for; decode.cpp runs the 120 GEMVs of a decode step
// inside ONE parallel region of its own, each thread taking its part of every GEMV between spin barriers.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "amx.h"

namespace minisgl {
namespace cpu {

constexpr int kGemvMaxM = 8;  // rows of x per kernel call (more rows: blocks of 8, each re-streaming W)

// Arguments of one kernel call: y[m, n] = x[m, :] . W[n, :] (+ bias[n]) for the rows n of a range.
struct LinArgs {
  const uint16_t* w = nullptr;  // [N, K] bf16 bits, contiguous
  int64_t N = 0, K = 0;
  const float* xf = nullptr;     // [M, K] fp32, contiguous (the fp32 kernels)
  const uint16_t* xb = nullptr;  // [M, xs] bf16 bits (the dpbf16 kernel), last dim contiguous
  int64_t xs = 0;
  const float* bias = nullptr;   // [N] fp32 or null
  float* y = nullptr;            // [M, ys] fp32 output (values rounded through bf16 if y_rounded), or
  uint16_t* yb = nullptr;        // [M, ys] bf16 output (rounded to nearest even, as torch rounds)
  bool y_rounded = false;
  int64_t ys = 0;
  int M = 0;
};

using GemvBlockFn = void (*)(const LinArgs&, int64_t n0, int64_t n1);

// A GEMV y[M, N] = x[M, K] @ W[N, K]^T (+ bias) split into `parts` contiguous ranges of the N outputs (each a
// multiple of 8 rows, about equal: each thread streams its own part of W).
struct GemvPlan {
  const uint16_t* w = nullptr;
  const float* bias = nullptr;  // fp32 [N] or null; must outlive the plan's runs
  int64_t N = 0, K = 0, M = 0, parts = 1, per = 0;
  bool dp = false;  // x is read as bf16 by the dot-product kernel; otherwise as fp32
  GemvBlockFn fns[kGemvMaxM + 1] = {};
};

// weight: bf16 [N, K] contiguous; isa: "" (the best here) or a narrower variant's name (tests).
GemvPlan make_gemv_plan(const at::Tensor& weight, const float* bias, int64_t M, bool x_bf16, int64_t parts,
                        const std::string& isa);

// How y is written: fp32, bf16, or fp32 holding bf16-rounded values (what `linear(x).float()` gives for a
// bf16 linear, written in one pass).
enum class YFormat { f32, bf16, f32_bf16_rounded };

// Runs part `part` of the plan. x: [M, xs] bf16 bits (x_bf16) or contiguous fp32 (xs == K); y: [M, ys] as `yf` says.
// A bf16 x on a plan that reads fp32 is converted into a per-thread buffer first.
void run_gemv_part(const GemvPlan& p, const void* x, int64_t xs, bool x_bf16, void* y, int64_t ys, YFormat yf,
                   int64_t part);

// The batch kernel over packed weights (gemm_bf16.cpp: AVX512-BF16 dot products, or fp32 FMAs on W widened in
// registers, AVX-512 or AVX2; or gemm_amx.cpp: AMX tiles):
// W packed by pack_linear_weight as [nblk = ceil(N/16), K2 = K/2, 16, 2], split into `parts` contiguous ranges of
// output blocks.
// Which body runs a plan's tiles: the CPU's default (gemm_bf16.cpp: AVX512-BF16 dot products, else fp32 FMAs), the
// AVX-512 fp32 FMA body where AVX512-BF16's is the default, or AMX (gemm_amx.cpp).
enum class TilesBody { standard, fma, amx };

// The body the Python API's two flags name (linear_packed's amx and fma, decode_layers' lists): at most one.
TilesBody tiles_body(bool amx, bool fma);

struct TilesPlan {
  const uint16_t* wp = nullptr;
  const float* bias = nullptr;  // fp32 [N] or null; must outlive the plan's runs
  int64_t N = 0, K2 = 0, nblk = 0, parts = 1, per = 0;
  TilesBody body = TilesBody::standard;
};

// Checked: amx runs only where the CPU and OS allow it and K is a multiple of 32; fma where linear_fma_available().
TilesPlan make_tiles_plan(const at::Tensor& packed, int64_t N, const float* bias, int64_t parts,
                          TilesBody body = TilesBody::standard);

// gemm_amx.cpp: output blocks [nb0, nb1) of a plan on AMX (see amx.h for amx_available and release_amx).
void run_amx_part(const TilesPlan& p, const uint16_t* x, int64_t xs, int64_t M, void* y, int64_t ys, bool y_f32,
                  int64_t nb0, int64_t nb1);

// Runs part `part`: x bf16 bits [M, xs]; y [M, ys] as bf16 or as fp32 holding bf16 values (yf != f32).
void run_tiles_part(const TilesPlan& p, const void* x, int64_t xs, int64_t M, void* y, int64_t ys, YFormat yf,
                    int64_t part);

}  // namespace cpu
}  // namespace minisgl
