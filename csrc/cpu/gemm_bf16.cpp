// gemm_bf16.cpp -- y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a batch of decode rows (M up to a few dozen), bf16,
// with W repacked once so that no horizontal sums are needed.
//
// The GEMV (linear.cpp) dots one weight row with each row of x and pays one 16-lane horizontal sum per output:
// fine for M <= 3, where reading W is the whole cost, but at M = 32 the sums and the re-streaming of W per block
// of 8 rows make it slower than oneDNN, which itself reached only ~265 GFLOP/s here, under a third of what two
// cores' `vdpbf16ps` can do (~930 GFLOP/s measured). This kernel uses the layout of a register-blocked GEMM:
//   - W is packed as [N/16][K/2][16][2]: a 64-byte line holds two consecutive k of 16 consecutive outputs, which
//     is what `vdpbf16ps` multiplies with a broadcast pair (x[m, k], x[m, k + 1]);
//   - a block of MB <= 8 rows of x times NB = 3 blocks of 16 outputs keeps 24 fp32 accumulators in registers;
//     per pair of k it loads 3 lines of W and broadcasts MB pairs of x (0.46 loads per dot-product instruction);
//   - the outputs of a block come out as whole vectors: bias added, rounded to bf16, stored (masked at the edge);
//   - threads take contiguous ranges of output blocks; each tile of W (55 KB at K = 576) serves all rows of x
//     before the next is read, so W streams from memory once whatever M (rows beyond 8 re-read it from L2).
// Packing pads N to a multiple of 16 with zero rows; K must be even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "../ops.h"
#include "gemv.h"

#pragma GCC diagnostic ignored "-Wpsabi"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MINISGL_GEMM_X86 1
#endif

namespace minisgl {
namespace cpu {
namespace {

constexpr int kNB = 3;  // blocks of 16 outputs per register tile
constexpr int kMB = 8;  // rows of x per register tile

bool has_bf16_dot() {
#ifdef MINISGL_GEMM_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    // MINISGL_CPU_ISA=avx512|avx2|baseline caps the kernels below AVX512-BF16 (as for the GEMV and attention)
    const char* cap = std::getenv("MINISGL_CPU_ISA");
    if (cap && *cap && std::string(cap) != "avx512bf16") return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return ok;
#else
  return false;
#endif
}

#ifdef MINISGL_GEMM_X86
#define MINISGL_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// Rows [m0, m0 + MB) of x times output blocks [nb, nb + NB): acc[m][j] += x[m, k:k+2] * W[16 (nb + j) .. +16, k:k+2].
template <int MB, int NB>
MINISGL_TBF16 inline void tile(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t K2, const float* bias,
                               void* y, int64_t ys, bool y_f32, int64_t N, int64_t nb) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint16_t* w0 = wp + nb * K2 * 32;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(w0 + (j * K2 + kp) * 32);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      __builtin_memcpy(&pair, x + m * xs + 2 * kp, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, w[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (nb + j) * 16;
    const int64_t valid = std::min<int64_t>(16, N - n0);
    if (valid <= 0) break;
    const __mmask16 mk = valid == 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) {
      const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m][j], b));  // round to nearest even
      if (y_f32) _mm512_mask_storeu_ps(static_cast<float*>(y) + m * ys + n0, mk, _mm512_cvtpbh_ps(r));
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + m * ys + n0, mk, (__m256i)r);
    }
  }
}

// One tile of nbw (1..kNB) output blocks for all M rows of x, kMB rows at a time: the tile's W (3 x K x 32
// bytes, 55 KB at K = 576) is read from memory once and from the caches for the next rows.
template <int NB>
MINISGL_TBF16 void tile_all_rows(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t K2,
                                 const float* bias, void* y0, int64_t ys, bool y_f32, int64_t N, int64_t nb) {
  int64_t m0 = 0;
  auto yrow = [&](int64_t m) -> void* {
    return y_f32 ? static_cast<void*>(static_cast<float*>(y0) + m * ys) : static_cast<void*>(static_cast<uint16_t*>(y0) + m * ys);
  };
  for (; m0 + kMB <= M; m0 += kMB) tile<kMB, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb);
  switch (M - m0) {
    case 1: tile<1, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 2: tile<2, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 3: tile<3, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 4: tile<4, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 5: tile<5, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 6: tile<6, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    case 7: tile<7, NB>(x + m0 * xs, xs, wp, K2, bias, yrow(m0), ys, y_f32, N, nb); break;
    default: break;
  }
}

MINISGL_TBF16 void blocks(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t K2, const float* bias,
                          void* y, int64_t ys, bool y_f32, int64_t N, int64_t nb0, int64_t nb1) {
  int64_t nb = nb0;
  for (; nb + kNB <= nb1; nb += kNB) tile_all_rows<kNB>(x, xs, M, wp, K2, bias, y, ys, y_f32, N, nb);
  for (; nb < nb1; ++nb) tile_all_rows<1>(x, xs, M, wp, K2, bias, y, ys, y_f32, N, nb);
}
#endif

}  // namespace

TilesPlan make_tiles_plan(const at::Tensor& packed, int64_t N, const float* bias, int64_t parts) {
  TilesPlan p;
  p.wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  p.bias = bias;
  p.N = N;
  p.K2 = packed.size(1);
  p.nblk = packed.size(0);
  // Contiguous ranges of output blocks, a multiple of kNB, about equal per part.
  const int64_t tiles = (p.nblk + kNB - 1) / kNB;
  p.parts = std::max<int64_t>(1, std::min<int64_t>(parts, tiles));
  p.per = (tiles + p.parts - 1) / p.parts * kNB;
  return p;
}

void run_tiles_part(const TilesPlan& p, const void* x, int64_t xs, int64_t M, void* y, int64_t ys, YFormat yf,
                    int64_t part) {
#ifdef MINISGL_GEMM_X86
  TORCH_INTERNAL_ASSERT(yf != YFormat::f32, "linear_packed: writes bf16 values (as bf16 or fp32)");
  const int64_t nb0 = part * p.per, nb1 = std::min(p.nblk, nb0 + p.per);
  if (nb0 < nb1)
    blocks(static_cast<const uint16_t*>(x), xs, M, p.wp, p.K2, p.bias, y, ys, yf == YFormat::f32_bf16_rounded, p.N,
           nb0, nb1);
#endif
}

}  // namespace cpu

bool linear_packed_available() { return cpu::has_bf16_dot(); }

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "pack_linear_weight: weight must be a bfloat16 CPU tensor [N, K], got ", weight.sizes(), " ",
              weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack_linear_weight: K must be even, got ", K);
  const int64_t NB = (N + 15) / 16;
  // [N, K] -> pad N -> [NB, 16, K/2, 2] -> [NB, K/2, 16, 2]
  auto w = at::zeros({NB * 16, K}, weight.options());
  w.narrow(0, 0, N).copy_(weight);
  return w.view({NB, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

at::Tensor linear_packed(const at::Tensor& x_in, const at::Tensor& packed, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  using namespace cpu;
  TORCH_CHECK(linear_packed_available(), "linear_packed: needs a CPU with AVX512-BF16 (use linear_gemv or torch)");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_packed: x must be a bfloat16 CPU tensor [M, K], got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16,
              "linear_packed: packed must come from pack_linear_weight, got ", packed.sizes());
  const int64_t M = x_in.size(0), K2 = packed.size(1), K = 2 * K2, NBLK = packed.size(0);
  TORCH_CHECK(x_in.size(1) == K, "linear_packed: x has K=", x_in.size(1), " columns but the weight has K=", K);
  TORCH_CHECK(N > (NBLK - 1) * 16 && N <= NBLK * 16, "linear_packed: N=", N, " does not match the packed weight's ",
              NBLK, " blocks of 16 rows");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu(),
                "linear_packed: bias must be a CPU tensor [N] = [", N, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  auto out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  const auto x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const TilesPlan p = make_tiles_plan(packed, N, b.defined() ? b.data_ptr<float>() : nullptr, at::get_num_threads());
  at::parallel_for(0, p.parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t t = p0; t < p1; ++t) run_tiles_part(p, x.data_ptr(), x.stride(0), M, out.data_ptr(), N, YFormat::bf16, t);
  });
  return out;
}

}  // namespace minisgl
