// gemm_bf16.cpp -- y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a batch of rows (decode batches and prefill
// chunks), bf16, with W repacked once so that no horizontal sums are needed.
//
// The GEMV (linear.cpp) dots one weight row with each row of x and pays one horizontal sum per output: fine
// for M <= 3, where reading W is the whole cost, but at M = 32 the sums and the re-streaming of W per block of
// 8 rows make it slower than oneDNN. This kernel uses the layout of a register-blocked GEMM:
//   - W is packed as [N/16][K/2][16][2]: a 64-byte line holds two consecutive k of 16 consecutive outputs, i.e.
//     16 32-bit words, word n = (W[n, k], W[n, k + 1]);
//   - three bodies read that one layout; tiles_isa() picks the default once at run time:
//     avx512bf16: `vdpbf16ps` multiplies a line with a broadcast pair (x[m, k], x[m, k + 1]) and sums the pair
//       in fp32; a block of MB <= 8 rows of x times NB = 3 lines keeps 24 accumulators in registers (0.46 loads
//       per dot-product instruction);
//     avx512 (AVX-512 CPUs without BF16; on those with it, `linear_packed(..., fma=True)`): W widened to fp32
//       in registers, as the avx2 body below does, and multiplied by FMAs on zmm, 8 rows x 3 lines (24
//       accumulators of 32 registers). Where a CPU has AVX512-BF16, which body is faster depends on the CPU:
//       on the project's Intel Xeon, `vdpbf16ps` ran at half the rate of fp32 FMAs (a register-only probe,
//       benchmarks/bench_roofline.py: 247 against 498 GFLOP/s on 2 cores), and this body ran the model's
//       matmuls 1.2-1.6x faster from 16 rows on. So the kernel plan (chapter 04c) times both ('tiles', 'fma');
//     avx2 (x86 CPUs with AVX2 and FMA, no AVX-512): a bf16 is the top half of an
//       fp32, so one 32-byte load of a line's half gives W[n, k] as fp32 by a 16-bit shift left and W[n, k+1]
//       by clearing its low half (two shifts); each is multiplied with a broadcast fp32 x[m, k] by FMA. A block of 6 rows
//       of x times one line (2 vectors of 8 outputs) keeps 12 accumulators of the 16 registers; x is widened
//       to fp32 once per chunk of rows (256 KB of fp32, half of a common L2), and one block of W (K x 32 bytes)
//       serves the chunk's rows from L1 while it fits there (K up to ~1000), else from L2; W is read from
//       memory once per chunk;
//   - the outputs of a block come out as whole vectors: bias added, rounded to bf16 (nearest even, as torch
//     rounds), stored (masked at the edge);
//   - threads take contiguous ranges of output blocks, so each reads its own part of W.
// Packing pads N to a multiple of 16 with zero rows; K must be even.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

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

// The bodies take a register tile's row count as a template argument, so that their accumulators stay in
// registers: for_row_tiles<MB>(M, tile) calls tile(m, rows) for rows [0, M) in tiles of MB rows, the last one
// smaller, with `rows` a std::integral_constant.
template <int R, typename Tile>
inline void last_row_tile(int64_t rest, int64_t m, Tile& tile) {
  if constexpr (R > 0) {
    if (rest == R) tile(m, std::integral_constant<int, R>{});
    else last_row_tile<R - 1>(rest, m, tile);
  }
}

template <int MB, typename Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  int64_t m = 0;
  for (; m + MB <= M; m += MB) tile(m, std::integral_constant<int, MB>{});
  last_row_tile<MB - 1>(M - m, m, tile);
}

enum class TilesIsa { none, avx2, avx512, avx512bf16 };

bool cpu_has_avx512() {
#ifdef MINISGL_GEMM_X86
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// MINISGL_CPU_ISA=avx512 caps the body at avx512 ("AVX-512 without BF16": fp32 FMAs on zmm), avx2 at avx2,
// baseline turns the tiles off, as for the GEMV and the attention.
TilesIsa tiles_isa() {
#ifdef MINISGL_GEMM_X86
  static const TilesIsa isa = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("MINISGL_CPU_ISA");
    const std::string want = cap ? cap : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512bf16");
    if (want == "baseline") return TilesIsa::none;
    if (bf16 && (want.empty() || want == "avx512bf16")) return TilesIsa::avx512bf16;
    if (cpu_has_avx512() && want != "avx2") return TilesIsa::avx512;
    return avx2 ? TilesIsa::avx2 : TilesIsa::none;
  }();
  return isa;
#else
  return TilesIsa::none;
#endif
}

#ifdef MINISGL_GEMM_X86
#define MINISGL_TBF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#define MINISGL_T512F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

// The lanes of output block n0 (16 outputs from n0) below N: 0 when the block lies past N.
MINISGL_T512F inline __mmask16 out_lanes(int64_t N, int64_t n0) {
  const int64_t valid = std::min<int64_t>(16, N - n0);
  return valid <= 0 ? 0 : valid == 16 ? (__mmask16)0xffff : (__mmask16)((1u << valid) - 1u);
}

// The bias of output block n0 in lanes mk (zeros without a bias).
MINISGL_T512F inline __m512 out_bias(const float* bias, __mmask16 mk, int64_t n0) {
  return bias ? _mm512_maskz_loadu_ps(mk, bias + n0) : _mm512_setzero_ps();
}

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
    const __mmask16 mk = out_lanes(N, n0);
    if (!mk) break;
    const __m512 b = out_bias(bias, mk, n0);
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
  const size_t esz = y_f32 ? sizeof(float) : sizeof(uint16_t);
  for_row_tiles<kMB>(M, [&](int64_t m, auto rows) {
    tile<decltype(rows)::value, NB>(x + m * xs, xs, wp, K2, bias, static_cast<char*>(y0) + m * ys * esz, ys, y_f32, N, nb);
  });
}

MINISGL_TBF16 void blocks(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t K2, const float* bias,
                          void* y, int64_t ys, bool y_f32, int64_t N, int64_t nb0, int64_t nb1) {
  int64_t nb = nb0;
  for (; nb + kNB <= nb1; nb += kNB) tile_all_rows<kNB>(x, xs, M, wp, K2, bias, y, ys, y_f32, N, nb);
  for (; nb < nb1; ++nb) tile_all_rows<1>(x, xs, M, wp, K2, bias, y, ys, y_f32, N, nb);
}

// ---------------------------------------------------------------- x widened to fp32, for the widening bodies
// Rows [0, rows) of x (bf16, row stride xs) into dst (fp32, row stride K): a bf16 is the top half of an fp32.
__attribute__((target("avx2,fma"))) void widen_rows(const uint16_t* x, int64_t xs, int64_t rows, int64_t K,
                                                    float* dst) {
  for (int64_t m = 0; m < rows; ++m, dst += K) {
    const uint16_t* src = x + m * xs;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(
                                    _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))), 16)));
    for (; k < K; ++k) dst[k] = __builtin_bit_cast(float, uint32_t(src[k]) << 16);
  }
}

// x in chunks of rows (256 KB of fp32, half of a common L2; a multiple of a register tile's `mb` rows), each
// widened once into this thread's buffer: body(xf, rows, yc) with xf the chunk's fp32 rows (stride K) and yc
// the chunk's first row of y.
template <typename Body>
void for_widened_chunks(const uint16_t* x, int64_t xs, int64_t M, int64_t K, int64_t mb, void* y0, int64_t ys,
                        size_t esz, Body&& body) {
  const int64_t chunk = std::max<int64_t>(mb, (256 << 10) / (4 * K) / mb * mb);
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(std::min(chunk, M) * K));
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t rows = std::min(chunk, M - c0);
    widen_rows(x + c0 * xs, xs, rows, K, buf.data());
    body(buf.data(), rows, static_cast<char*>(y0) + c0 * ys * esz);
  }
}

// ---------------------------------------------------------------- avx512: W widened to fp32, zmm FMAs

constexpr int kMB5 = 8;  // rows of x per zmm register tile: 8 x 3 accumulators + 3 of W + 1 of x (of 32 registers)

// Rows [0, MB) of the fp32 chunk xf (row stride K) times output blocks [nb, nb + NB) (16 outputs each).
template <int MB, int NB>
MINISGL_T512F inline void tile_512(const float* xf, int64_t K, const uint16_t* wp, int64_t K2, const float* bias,
                                   void* y, int64_t ys, bool y_f32, int64_t N, int64_t nb) {
  __m512 acc[MB][NB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint16_t* w0 = wp + nb * K2 * 32;
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512i line[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) line[j] = _mm512_loadu_si512(w0 + (j * K2 + kp) * 32);
    __m512 w[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(line[j], 16));   // W[n, k]
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(xf[m * K + 2 * kp]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, w[j], acc[m][j]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) w[j] = _mm512_castsi512_ps(_mm512_and_si512(line[j], hi_mask));   // W[n, k + 1]
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_set1_ps(xf[m * K + 2 * kp + 1]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_fmadd_ps(xv, w[j], acc[m][j]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j) {
    const int64_t n0 = (nb + j) * 16;
    const __mmask16 mk = out_lanes(N, n0);
    if (!mk) break;
    const __m512 b = out_bias(bias, mk, n0);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m512i u = _mm512_castps_si512(_mm512_add_ps(acc[m][j], b));
      // round to nearest even (NaN: a quiet NaN), as torch rounds
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
      const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(u), _mm512_castsi512_ps(u), _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
      if (y_f32) _mm512_mask_storeu_ps(static_cast<float*>(y) + m * ys + n0, mk, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
      else _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + m * ys + n0, mk, _mm512_cvtepi32_epi16(r));
    }
  }
}

template <int NB>
MINISGL_T512F void tile_512_rows(const float* xf, int64_t K, int64_t rows, const uint16_t* wp, int64_t K2,
                                 const float* bias, char* yc, int64_t ys, size_t esz, bool y_f32, int64_t N, int64_t nb) {
  for_row_tiles<kMB5>(rows, [&](int64_t m, auto mb) {
    tile_512<decltype(mb)::value, NB>(xf + m * K, K, wp, K2, bias, yc + m * ys * esz, ys, y_f32, N, nb);
  });
}

// Output blocks [nb0, nb1) for all M rows: rows in chunks of 256 KB of fp32 (widened once per chunk), then for
// each tile of kNB blocks, the chunk's rows kMB5 at a time.
MINISGL_T512F void blocks_512(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t K2,
                              const float* bias, void* y0, int64_t ys, bool y_f32, int64_t N, int64_t nb0, int64_t nb1) {
  const int64_t K = 2 * K2;
  const size_t esz = y_f32 ? sizeof(float) : sizeof(uint16_t);
  for_widened_chunks(x, xs, M, K, kMB5, y0, ys, esz, [&](const float* xf, int64_t rows, char* yc) {
    int64_t nb = nb0;
    for (; nb + kNB <= nb1; nb += kNB) tile_512_rows<kNB>(xf, K, rows, wp, K2, bias, yc, ys, esz, y_f32, N, nb);
    for (; nb < nb1; ++nb) tile_512_rows<1>(xf, K, rows, wp, K2, bias, yc, ys, esz, y_f32, N, nb);
  });
}

// ---------------------------------------------------------------- avx2: W widened to fp32 in registers
#define MINISGL_T256 __attribute__((target("avx2,fma")))

constexpr int kMB2 = 6;  // rows of x per avx2 register tile: 6 x 2 accumulators + 2 of W + 1 of x

// fp32 -> bf16 bits, rounded to nearest even (NaN stays a quiet NaN), 8 at a time.
MINISGL_T256 inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  // 8 words with their value in the low 16 bits -> 8 packed bf16 (packus works per 128-bit lane)
  const __m256i p = _mm256_packus_epi32(r, r);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(p, 0x08));
}

// Adds the bias b to v, rounds it to bf16 and stores the first `valid` of its 8 outputs in row y (bf16, or fp32
// holding the bf16 value).
MINISGL_T256 __attribute__((always_inline)) inline void store8(__m256 v, __m256 b, void* y, bool y_f32, int64_t valid) {
  const __m128i r = to_bf16x8(_mm256_add_ps(v, b));
  if (y_f32) {
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r), 16)));
    std::copy(out, out + valid, static_cast<float*>(y));
  } else if (valid == 8) {
    _mm_storeu_si128(static_cast<__m128i*>(y), r);
  } else {
    alignas(16) uint16_t out[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(out), r);
    std::copy(out, out + valid, static_cast<uint16_t*>(y));
  }
}

MINISGL_T256 inline __m256 bias8(const float* bias, int64_t n0, int64_t valid) {
  alignas(32) float bb[8] = {};
  if (bias) for (int64_t i = 0; i < valid; ++i) bb[i] = bias[n0 + i];
  return _mm256_load_ps(bb);
}

// Rows [0, MB) of the fp32 chunk xf (row stride K) times output block nb (16 outputs, two vectors of 8:
// lo and hi). The accumulators are separate named arrays indexed by constants only, so they stay in registers.
template <int MB>
MINISGL_T256 inline void tile_256(const float* xf, int64_t K, const uint16_t* wp, int64_t K2, const float* bias,
                                  void* y, int64_t ys, bool y_f32, int64_t N, int64_t nb) {
  __m256 lo[MB], hi[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  const __m256i* w = reinterpret_cast<const __m256i*>(wp + nb * K2 * 32);
  for (int64_t kp = 0; kp < K2; ++kp, w += 2) {
    const __m256i l0 = _mm256_loadu_si256(w), l1 = _mm256_loadu_si256(w + 1);
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(l0, 16)), e1 = _mm256_castsi256_ps(_mm256_slli_epi32(l1, 16));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xf + m * K + 2 * kp);
      lo[m] = _mm256_fmadd_ps(xv, e0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, e1, hi[m]);
    }
    // W[n, k + 1]: clear the low half by two shifts (a mask would hold a 16th register and spill accumulators)
    const __m256 o0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(l0, 16), 16));
    const __m256 o1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(l1, 16), 16));
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_broadcast_ss(xf + m * K + 2 * kp + 1);
      lo[m] = _mm256_fmadd_ps(xv, o0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, o1, hi[m]);
    }
  }
  const size_t esz = y_f32 ? sizeof(float) : sizeof(uint16_t);
  const int64_t n0 = nb * 16, v0 = std::min<int64_t>(8, N - n0), v1 = std::min<int64_t>(8, N - n0 - 8);
  const __m256 b0 = bias8(bias, n0, v0);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) store8(lo[m], b0, static_cast<char*>(y) + (m * ys + n0) * esz, y_f32, v0);
  if (v1 <= 0) return;
  const __m256 b1 = bias8(bias, n0 + 8, v1);
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) store8(hi[m], b1, static_cast<char*>(y) + (m * ys + n0 + 8) * esz, y_f32, v1);
}

// One output block for a chunk's fp32 rows xf (stride K), kMB2 rows at a time.
MINISGL_T256 void tile_256_rows(const float* xf, int64_t K, int64_t rows, const uint16_t* wp, int64_t K2,
                                const float* bias, char* yc, int64_t ys, size_t esz, bool y_f32, int64_t N, int64_t nb) {
  for_row_tiles<kMB2>(rows, [&](int64_t m, auto mb) {
    tile_256<decltype(mb)::value>(xf + m * K, K, wp, K2, bias, yc + m * ys * esz, ys, y_f32, N, nb);
  });
}

// Output blocks [nb0, nb1) for all M rows: rows in chunks of 256 KB of fp32 (widened once per chunk), then for
// each block, the chunk's rows kMB2 at a time (the block's W, K x 32 bytes, stays in L1, or L2 past K ~ 1000).
MINISGL_T256 void blocks_256(const uint16_t* x, int64_t xs, int64_t M, const uint16_t* wp, int64_t K2,
                             const float* bias, void* y0, int64_t ys, bool y_f32, int64_t N, int64_t nb0, int64_t nb1) {
  const int64_t K = 2 * K2;
  const size_t esz = y_f32 ? sizeof(float) : sizeof(uint16_t);
  for_widened_chunks(x, xs, M, K, kMB2, y0, ys, esz, [&](const float* xf, int64_t rows, char* yc) {
    for (int64_t nb = nb0; nb < nb1; ++nb) tile_256_rows(xf, K, rows, wp, K2, bias, yc, ys, esz, y_f32, N, nb);
  });
}
#endif

}  // namespace

TilesBody tiles_body(bool amx, bool fma) {
  TORCH_CHECK(!(amx && fma), "linear_packed: amx and fma name two bodies; give at most one");
  return amx ? TilesBody::amx : fma ? TilesBody::fma : TilesBody::standard;
}

TilesPlan make_tiles_plan(const at::Tensor& packed, int64_t N, const float* bias, int64_t parts, TilesBody body) {
  const bool amx = body == TilesBody::amx, fma = body == TilesBody::fma;
  TORCH_CHECK(!amx || amx_available(), "linear_packed: AMX does not run here (amx_available() is false)");
  TORCH_CHECK(!fma || linear_fma_available(), "linear_packed: the AVX-512 FMA body does not run here "
              "(linear_fma_available() is false)");
  TORCH_CHECK(!amx || packed.size(1) % 16 == 0, "linear_packed: AMX needs K a multiple of 32, got K=", 2 * packed.size(1));
  TilesPlan p;
  p.body = body;
  p.wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  p.bias = bias;
  p.N = N;
  p.K2 = packed.size(1);
  p.nblk = packed.size(0);
  // Contiguous ranges of output blocks, a multiple of the body's register tile (kNB blocks; AMX: 2), about equal per part.
  const int64_t unit = amx ? 2 : kNB, tiles = (p.nblk + unit - 1) / unit;
  p.parts = std::max<int64_t>(1, std::min<int64_t>(parts, tiles));
  p.per = (tiles + p.parts - 1) / p.parts * unit;
  return p;
}

void run_tiles_part(const TilesPlan& p, const void* x, int64_t xs, int64_t M, void* y, int64_t ys, YFormat yf,
                    int64_t part) {
#ifdef MINISGL_GEMM_X86
  TORCH_INTERNAL_ASSERT(yf != YFormat::f32, "linear_packed: writes bf16 values (as bf16 or fp32)");
  const int64_t nb0 = part * p.per, nb1 = std::min(p.nblk, nb0 + p.per);
  if (nb0 >= nb1) return;
  const bool y_f32 = yf == YFormat::f32_bf16_rounded;
  if (p.body == TilesBody::amx)
    run_amx_part(p, static_cast<const uint16_t*>(x), xs, M, y, ys, y_f32, nb0, nb1);
  else if (p.body == TilesBody::fma || tiles_isa() == TilesIsa::avx512)
    blocks_512(static_cast<const uint16_t*>(x), xs, M, p.wp, p.K2, p.bias, y, ys, y_f32, p.N, nb0, nb1);
  else if (tiles_isa() == TilesIsa::avx512bf16)
    blocks(static_cast<const uint16_t*>(x), xs, M, p.wp, p.K2, p.bias, y, ys, y_f32, p.N, nb0, nb1);
  else
    blocks_256(static_cast<const uint16_t*>(x), xs, M, p.wp, p.K2, p.bias, y, ys, y_f32, p.N, nb0, nb1);
#endif
}

}  // namespace cpu

bool linear_packed_available() { return cpu::tiles_isa() != cpu::TilesIsa::none; }

bool linear_amx_available() { return linear_packed_available() && cpu::amx_available(); }

bool linear_fma_available() {
  const auto isa = cpu::tiles_isa();
  return (isa == cpu::TilesIsa::avx512bf16 || isa == cpu::TilesIsa::avx512) && cpu::cpu_has_avx512();
}

std::string linear_packed_isa() {
  switch (cpu::tiles_isa()) {
    case cpu::TilesIsa::avx512bf16: return "avx512bf16";
    case cpu::TilesIsa::avx512: return "avx512";
    case cpu::TilesIsa::avx2: return "avx2";
    default: return "none";
  }
}

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
                         const c10::optional<at::Tensor>& bias, bool amx, bool fma) {
  using namespace cpu;
  TORCH_CHECK(linear_packed_available(), "linear_packed: needs a CPU with AVX2 and FMA (use linear_gemv or torch)");
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
  const TilesPlan p =
      make_tiles_plan(packed, N, b.defined() ? b.data_ptr<float>() : nullptr, at::get_num_threads(), tiles_body(amx, fma));
  at::parallel_for(0, p.parts, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t t = p0; t < p1; ++t) run_tiles_part(p, x.data_ptr(), x.stride(0), M, out.data_ptr(), N, YFormat::bf16, t);
    if (amx) release_amx();
  });
  return out;
}

}  // namespace minisgl
