// quant.cpp -- linears over quantized weights: GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and minisgl's per-channel
// int8 (I8), read as they are stored, 4 to 8 bits a weight.
//
// Every format is a row of blocks of 32 weights w = s * u + b, with u an unsigned integer (0..15, 0..31, 0..63 or
// 0..255: Q8_0's and I8's signed q read as u = q + 128), s a scale and b an offset that the block shares (Q6_K:
// two halves of 16 with their own s and b). The activations are quantized per block of 32 as llama.cpp does
// (q8 = round(x / dx), dx = max|x| / 127), and then one block's dot product is
//     sum(w * x) ~= s * dx * (u . q8) + b * dx * sum(q8)
// where u . q8 is an integer dot product: AVX512-VNNI's `vpdpbusd` (unsigned bytes times signed bytes, four
// products summed into each int32 lane). The error is the activations' rounding only: at most dx / 2 per element.
//
// Layout: sixteen rows interleaved. quant/repack (Python, chapter quant) rewrites each group of 16 GGUF rows into
// the same bytes (+4 per 256 weights for Q4_K and Q5_K, whose 6-bit scales are unpacked), arranged so that one
// 64-byte load is 16 lanes, lane r holding 4 consecutive quants of row r (a "quad"). `vpdpbusd` with one quad of x
// broadcast to every lane then advances 16 outputs at once: no horizontal sums, and a block's scales are one
// vector of 16 (one per row) applied once per block, not once per row and block. Per group of 16 rows (each
// scale array below is [16], one per row; a chunk is 64 bytes, [16 rows][4 bytes]):
//   Q4_0: per block: d fp16          | 4 chunks: low nibbles quads 0-3, high nibbles quads 4-7 (GGUF's qs bytes)
//   Q4_1: per block: d fp16 | m fp16 | the same 4 chunks
//   Q5_0, Q5_1: per block: as Q4_0, Q4_1, with one chunk of fifth bits before the nibbles: a lane's byte e has in
//         bit c the fifth bit of its row's weight 4c + e (repack moves GGUF's qh bits there), so quad c takes bit c
//         (the fallback of K-quant files whose rows are not a multiple of 256, such as this project's 135M model)
//   Q8_0: per block: d fp16          | 8 chunks, quads 0-7
//   I8  : scale fp32 (once)          | per block: 8 chunks
//   Q4_K: per 256: d fp16 | dmin fp16 | sc u8 [8][16] | mn u8 [8][16] | 4 pairs of blocks x 8 chunks: low nibbles
//         the pair's first block, high nibbles its second (GGUF's qs bytes)
//   Q5_K: per 256: as Q4_K, with 8 chunks of GGUF's qh bytes (bit j: block j's fifth bit) before the quants
//   Q6_K: per 256: d fp16 | sc int8 [16][16] | 2 halves of 128 x (16 chunks of ql, 8 chunks of qh), GGUF's bytes
//
// Kernels: q8dot (VNNI) for any number of rows (up to 8 rows of x share each unpacked block of 16 weight rows in
// registers); qamx (AMX) dequantizes a block of 16 rows into a bf16 tile and multiplies it with x on AMX; a portable
// fallback dequantizes a row into fp32 (no VNNI, or MINISGL_CPU_ISA below avx512); quant_dequantize, exact, for
// tests, embedding rows and the layers that want bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MINISGL_Q_X86 1
#endif

#include "amx.h"
#include "isa.h"
#include "quant.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace minisgl {
namespace cpu {
namespace {

// GGML's type ids, and ours for I8.
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, I8 = 100 };

bool is_k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }

// Bytes of one repacked row of K weights (see the layout above); -1 for an unknown type or a K it cannot hold.
int64_t row_bytes(int64_t t, int64_t K) {
  if (K <= 0) return -1;
  if (is_k_quant(t) && K % 256) return -1;
  if (!is_k_quant(t) && K % 64) return -1;   // the activations are quantized in rows of 64
  const int64_t nb = K / 32, ns = K / 256;
  switch (t) {
    case Q4_0: return nb * 18;
    case Q4_1: return nb * 20;
    case Q5_0: return nb * 22;
    case Q5_1: return nb * 24;
    case Q8_0: return nb * 34;
    case Q4_K: return ns * 148;
    case Q5_K: return ns * 180;
    case Q6_K: return ns * 210;
    case I8: return K + 4;
    default: return -1;
  }
}

// Bytes of one group of 16 rows per block of 32 (the non-K formats) or per 256 (the K-quants, and I8's quants).
constexpr int64_t kRec40 = 16 * 18, kRec41 = 16 * 20, kRec50 = 16 * 22, kRec51 = 16 * 24, kRec80 = 16 * 34;
constexpr int64_t kRec4K = 16 * 148, kRec5K = 16 * 180, kRec6K = 16 * 210;

// Q5_K and Q6_K ask for the weight bytes kPfAhead ahead of the block they read, into the L2 (prefetcht1). A part
// streams its groups front to back, and the hardware prefetchers alone fall behind these two, whose blocks take the
// most instructions: `bench_quant.py --formats` on an AMD EPYC Zen 4, Q5_K 27-29 -> 34-43 GB/s and Q6_K 24-25 -> 34-36
// (VNNI body), and imitating AVX2 there Q5_K 19-21 -> 24-29, Q6_K 17-19 -> 23-25. The other formats do not ask in the
// VNNI body or in the AVX2 body's two passes (its one pass does, below): over
// 128 MB they gained within the noise on VNNI and lost up to 15% on AVX2, and one request from the Q4_1 file decoded
// ~5% slower with them (alternating builds). vec.h's prefetch_row (prefetcht2, the attention's) measured no better:
// Q5_K imitating AVX2 23-28 GB/s against 27-29 with prefetcht1, alternating builds.
#ifdef MINISGL_Q_X86
constexpr int64_t kPfAhead = 8192;

// A group's bytes per block of 32 weights (the K-quants' records hold 8 such blocks).
template <int64_t T>
constexpr int64_t group_block_bytes() {
  switch (T) {
    case Q4_0: return kRec40;
    case Q4_1: return kRec41;
    case Q5_0: return kRec50;
    case Q5_1: return kRec51;
    case Q8_0: return kRec80;
    case Q4_K: return kRec4K / 8;
    case Q5_K: return kRec5K / 8;
    case Q6_K: return kRec6K / 8;
    default: return 0;
  }
}

// Asks for block j's bytes `ahead` bytes further on into the L2 (prefetcht1).
template <int64_t T, int64_t ahead>
inline void prefetch_ahead(const uint8_t* g, int64_t j) {
  constexpr int64_t block = group_block_bytes<T>();
  const char* p = reinterpret_cast<const char*>(g + j * block + ahead);
  for (int64_t o = 0; o < block; o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
}

template <int64_t T>
inline void prefetch_block_ahead(const uint8_t* g, int64_t j) {
  if constexpr (T == Q5_K || T == Q6_K) prefetch_ahead<T, kPfAhead>(g, j);
}

// The AVX2 body's one pass over a group (one or two rows of x, below) asks for the other formats' bytes too, 4 KB
// ahead: on an AMD EPYC Zen 3 (AVX2 only) one request decoded 3-10% faster in three of four alternations and 1%
// slower in the fourth (medians of 7 x 128 tokens), and over 128 MB Q4_1 streamed at 15.0 against 10.6 GB/s on one
// core, Q5_0 at 22.8 against 18.2 on two (medians of 3-5 alternating runs on a busy machine). The two-pass body had
// lost with them.
template <int64_t T>
inline void prefetch_block_ahead_avx2(const uint8_t* g, int64_t j) {
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q5_1 || T == Q8_0) prefetch_ahead<T, 4096>(g, j);
  else prefetch_block_ahead<T>(g, j);
}
#endif

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

// ---------------------------------------------------------------- exact dequantization (the reference)
// Row n of a weight (its group's base g, lane r = n % 16), with the same fp32 operations, in the same order, as
// gguf-py's numpy dequantization (products of a fp16 scale and small integers are exact in fp32, so contraction
// into FMAs changes nothing either).
// T is a template argument, so that the format's branch is chosen once per row, not once per weight.
template <int64_t T>
void dequant_row_of(const uint8_t* g, int r, int64_t K, float* y) {
  const int64_t nb = K / 32;
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t s = j / 8, jj = j % 8;
    for (int c = 0; c < 8; ++c)
      for (int b = 0; b < 4; ++b) {
        const int64_t lane = 4 * r + b;
        float* out = y + j * 32 + 4 * c + b;
        if constexpr (T == Q4_0 || T == Q4_1) {
          const uint8_t* rec = g + j * (T == Q4_0 ? kRec40 : kRec41);
          const uint8_t q = rec[(T == Q4_0 ? 32 : 64) + 64 * (c % 4) + lane];
          const int u = c < 4 ? q & 15 : q >> 4;
          const float d = h2f(rec + 2 * r);
          *out = T == Q4_0 ? d * static_cast<float>(u - 8) : d * static_cast<float>(u) + h2f(rec + 32 + 2 * r);
        } else if constexpr (T == Q5_0 || T == Q5_1) {
          const uint8_t* rec = g + j * (T == Q5_0 ? kRec50 : kRec51);
          const uint8_t* qh = rec + (T == Q5_0 ? 32 : 64);
          const uint8_t q = qh[64 + 64 * (c % 4) + lane];
          const int u = (c < 4 ? q & 15 : q >> 4) | (qh[lane] >> c & 1) << 4;
          const float d = h2f(rec + 2 * r);
          *out = T == Q5_0 ? d * static_cast<float>(u - 16) : d * static_cast<float>(u) + h2f(rec + 32 + 2 * r);
        } else if constexpr (T == Q8_0) {
          const uint8_t* rec = g + j * kRec80;
          *out = h2f(rec + 2 * r) * static_cast<float>(static_cast<int8_t>(rec[32 + 64 * c + lane]));
        } else if constexpr (T == I8) {
          float sc;
          std::memcpy(&sc, g + 4 * r, 4);
          *out = sc * static_cast<float>(static_cast<int8_t>(g[64 + (8 * j + c) * 64 + lane]));
        } else if constexpr (T == Q4_K || T == Q5_K) {
          const uint8_t* rec = g + s * (T == Q4_K ? kRec4K : kRec5K);
          const uint8_t* qs = rec + (T == Q4_K ? 320 : 832);
          const uint8_t q = qs[(8 * (jj / 2) + c) * 64 + lane];
          int u = jj % 2 ? q >> 4 : q & 15;
          if constexpr (T == Q5_K) u += (rec[320 + 64 * c + lane] >> jj & 1) << 4;
          const float sc = h2f(rec + 2 * r) * static_cast<float>(rec[64 + 16 * jj + r]);
          const float mn = h2f(rec + 32 + 2 * r) * static_cast<float>(rec[192 + 16 * jj + r]);
          *out = sc * static_cast<float>(u) - mn;
        } else {   // Q6_K
          const uint8_t* rec = g + s * kRec6K;
          const int h = static_cast<int>(jj / 4), tq = static_cast<int>(jj % 4);
          const uint8_t* half = rec + 288 + 1536 * h;
          const int lo = half[(8 * (tq & 1) + c) * 64 + lane] >> (4 * (tq >> 1)) & 15;
          const int hi = half[1024 + 64 * c + lane] >> (2 * tq) & 3;
          const int sub = 8 * h + 2 * tq + (c >= 4);
          const float sc = h2f(rec + 2 * r) * static_cast<float>(static_cast<int8_t>(rec[32 + 16 * sub + r]));
          *out = sc * static_cast<float>((lo | hi << 4) - 32);
        }
      }
  }
}

void dequant_row(int64_t t, const uint8_t* g, int r, int64_t K, float* y) {
  switch (t) {
    case Q4_0: return dequant_row_of<Q4_0>(g, r, K, y);
    case Q4_1: return dequant_row_of<Q4_1>(g, r, K, y);
    case Q5_0: return dequant_row_of<Q5_0>(g, r, K, y);
    case Q5_1: return dequant_row_of<Q5_1>(g, r, K, y);
    case Q8_0: return dequant_row_of<Q8_0>(g, r, K, y);
    case Q4_K: return dequant_row_of<Q4_K>(g, r, K, y);
    case Q5_K: return dequant_row_of<Q5_K>(g, r, K, y);
    case Q6_K: return dequant_row_of<Q6_K>(g, r, K, y);
    case I8: return dequant_row_of<I8>(g, r, K, y);
    default: TORCH_CHECK(false, "unknown quantized type ", t);
  }
}

// ---------------------------------------------------------------- activations
// Rows [m0, m1) of x quantized per block of 32 (d = max|x| / 127, q8 = x * (1 / d) rounded to nearest even), with
// the per-block sums, 32 elements at a time on AVX-512 (only the VNNI kernel reads q8). A scalar loop here made
// quantizing 32 rows of 1536 activations cost as much as the matmul they fed (576 x 1536 at 32 rows: 300 us with
// it, 123 us with this, on the project's AMD EPYC).
#ifdef MINISGL_Q_X86
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline __m512 load16_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) void quantize_rows_of(QAct& a, const T* x, int64_t xs,
                                                                                  int64_t m0, int64_t m1) {
  const int64_t K = a.K, nb = K / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * xs;
    int8_t* q = a.q8.data() + a.q8_off + m * a.Kp;
    for (int64_t j = 0; j < nb; ++j) {
      const __m512 v0 = load16_f32(xr + j * 32), v1 = load16_f32(xr + j * 32 + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
      const __m512i r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j * 32), _mm512_cvtepi32_epi8(r0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j * 32 + 16), _mm512_cvtepi32_epi8(r1));
      const int sum0 = _mm512_reduce_add_epi32(r0), sum1 = _mm512_reduce_add_epi32(r1);
      a.s16[(m * nb + j) * 2] = d * static_cast<float>(sum0);
      a.s16[(m * nb + j) * 2 + 1] = d * static_cast<float>(sum1);
      a.s32[m * nb + j] = d * static_cast<float>(sum0 + sum1);
      a.i32[m * nb + j] = sum0 + sum1;
      a.d32[m * nb + j] = d;
    }
  }
}

// The same on AVX2: the same fp32 operations (so the same q8, dx and sums), 8 elements at a time.
template <typename T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load8_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
__attribute__((target("avx2,fma,f16c"))) inline int hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

template <typename T>
__attribute__((target("avx2,fma,f16c"))) void quantize_rows_avx2(QAct& a, const T* x, int64_t xs, int64_t m0,
                                                                 int64_t m1) {
  const int64_t K = a.K, nb = K / 32;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   // undoes packs' interleaving of 128-bit lanes
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * xs;
    int8_t* q = a.q8.data() + a.q8_off + m * a.Kp;
    for (int64_t j = 0; j < nb; ++j) {
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8_f32(xr + j * 32 + 8 * i);
      const __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                      _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
      const float amax = _mm_cvtss_f32(h);
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      __m256i r[4];
      for (int i = 0; i < 4; ++i) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
      const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + j * 32), _mm256_permutevar8x32_epi32(b, order));
      const int sum0 = hsum8(_mm256_add_epi32(r[0], r[1])), sum1 = hsum8(_mm256_add_epi32(r[2], r[3]));
      a.s16[(m * nb + j) * 2] = d * static_cast<float>(sum0);
      a.s16[(m * nb + j) * 2 + 1] = d * static_cast<float>(sum1);
      a.s32[m * nb + j] = d * static_cast<float>(sum0 + sum1);
      a.i32[m * nb + j] = sum0 + sum1;
      a.d32[m * nb + j] = d;
    }
  }
}
#else
template <typename T>
void quantize_rows_of(QAct&, const T*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quantized activations are made for the int8 kernel, which needs an x86 CPU");
}
template <typename T>
void quantize_rows_avx2(QAct&, const T*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "quantized activations are made for the int8 kernel, which needs an x86 CPU");
}
#endif

// Where y goes: [M, ys] fp32 (holding bf16-rounded values if `rounded`) or bf16.
struct YOut {
  float* f = nullptr;
  uint16_t* b = nullptr;
  int64_t ys = 0;
  bool rounded = false;
  void put(int64_t m, int64_t n, float v) const {
    if (b) b[m * ys + n] = c10::BFloat16(v).x;
    else f[m * ys + n] = rounded ? static_cast<float>(c10::BFloat16(v)) : v;
  }
};

// ---------------------------------------------------------------- portable fallback
// One weight row dequantized into fp32, then plain dot products with the activations as they are (more exact
// than the VNNI path, and slower: it is here so that every CPU runs every format).
void rows_portable(int64_t t, const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, const float* xf,
                   int64_t M, const float* bias, const YOut& y, int64_t col0) {
  std::vector<float> wr(K);
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(t, w + (n / 16) * 16 * rb, static_cast<int>(n % 16), K, wr.data());
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = xf + m * K;
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += wr[k] * xr[k];
      y.put(m, col0 + n, s + (bias ? bias[n] : 0.f));
    }
  }
}

#ifdef MINISGL_Q_X86
#define MINISGL_TQ __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

constexpr int kMC = 8;   // rows of x that share one unpacked block of 16 weight rows

MINISGL_TQ inline __m512i load64(const uint8_t* p) { return _mm512_loadu_si512(p); }
MINISGL_TQ inline __m512 f16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MINISGL_TQ inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MINISGL_TQ inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
MINISGL_TQ inline __m512i low4(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
MINISGL_TQ inline __m512i high4(__m512i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }

// Block j of a group of 16 rows (base g): its eight quads of unsigned quants q[c] (lane r: elements 4c..4c+3 of
// row r), and the scale and offset of each row for quads 0-3 (s0, b0) and 4-7 (s1, b1; Q6_K's second half of 16,
// the same as s0, b0 for every other format).
template <int64_t T>
MINISGL_TQ inline void block_of(const uint8_t* g, int64_t j, __m512i q[8], __m512& s0, __m512& b0, __m512& s1,
                                __m512& b1) {
  const int64_t s = j / 8, jj = j % 8;
  if constexpr (T == Q4_0 || T == Q4_1) {
    const uint8_t* rec = g + j * (T == Q4_0 ? kRec40 : kRec41);
    const uint8_t* qs = rec + (T == Q4_0 ? 32 : 64);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = load64(qs + 64 * i);
      q[i] = low4(v);
      q[i + 4] = high4(v);
    }
    s0 = f16x16(rec);
    b0 = T == Q4_0 ? _mm512_mul_ps(s0, _mm512_set1_ps(-8.f)) : f16x16(rec + 32);
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    const uint8_t* rec = g + j * (T == Q5_0 ? kRec50 : kRec51);
    const uint8_t* qh = rec + (T == Q5_0 ? 32 : 64);
    const __m512i h = load64(qh);
    for (int i = 0; i < 4; ++i) {
      const __m512i v = load64(qh + 64 + 64 * i);
      q[i] = low4(v);
      q[i + 4] = high4(v);
    }
    // bit c of each byte, moved to bit 4 and or-ed in: a shift and one ternary-logic op (q | t & 0x10) per quad
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    for (int c = 0; c < 8; ++c) {
      const __m512i t = c < 4 ? _mm512_slli_epi16(h, 4 - c) : c > 4 ? _mm512_srli_epi16(h, c - 4) : h;
      q[c] = _mm512_ternarylogic_epi32(q[c], t, bit4, 0xF8);   // a | b & c
    }
    s0 = f16x16(rec);
    b0 = T == Q5_0 ? _mm512_mul_ps(s0, _mm512_set1_ps(-16.f)) : f16x16(rec + 32);
  } else if constexpr (T == Q8_0 || T == I8) {
    const uint8_t* qs = T == Q8_0 ? g + j * kRec80 + 32 : g + 64 + j * 512;
    for (int c = 0; c < 8; ++c) q[c] = _mm512_xor_si512(load64(qs + 64 * c), _mm512_set1_epi8(static_cast<char>(0x80)));
    s0 = T == Q8_0 ? f16x16(g + j * kRec80) : _mm512_loadu_ps(g);
    b0 = _mm512_mul_ps(s0, _mm512_set1_ps(-128.f));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* rec = g + s * (T == Q4_K ? kRec4K : kRec5K);
    const uint8_t* qs = rec + (T == Q4_K ? 320 : 832) + (jj / 2) * 512;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = load64(qs + 64 * c);
      q[c] = jj % 2 ? high4(v) : low4(v);
      if constexpr (T == Q5_K) {   // bit jj of each qh byte, moved to bit 4
        const __m512i h = _mm512_and_si512(_mm512_srli_epi16(load64(rec + 320 + 64 * c), static_cast<unsigned>(jj)),
                                           _mm512_set1_epi8(1));
        q[c] = _mm512_or_si512(q[c], _mm512_slli_epi16(h, 4));
      }
    }
    s0 = _mm512_mul_ps(f16x16(rec), u8x16(rec + 64 + 16 * jj));
    b0 = _mm512_mul_ps(f16x16(rec + 32), _mm512_sub_ps(_mm512_setzero_ps(), u8x16(rec + 192 + 16 * jj)));
  } else {   // Q6_K
    const uint8_t* rec = g + s * kRec6K;
    const int h = static_cast<int>(jj / 4), tq = static_cast<int>(jj % 4);
    const uint8_t* half = rec + 288 + 1536 * h;
    for (int c = 0; c < 8; ++c) {
      const __m512i v = load64(half + (8 * (tq & 1) + c) * 64);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(load64(half + 1024 + 64 * c), 2 * tq), _mm512_set1_epi8(3));
      q[c] = _mm512_or_si512(tq >> 1 ? high4(v) : low4(v), _mm512_slli_epi16(hi, 4));
    }
    const __m512 d = f16x16(rec);
    const int sub = 8 * h + 2 * tq;
    s0 = _mm512_mul_ps(d, i8x16(rec + 32 + 16 * sub));
    s1 = _mm512_mul_ps(d, i8x16(rec + 32 + 16 * (sub + 1)));
    b0 = _mm512_mul_ps(s0, _mm512_set1_ps(-32.f));
    b1 = _mm512_mul_ps(s1, _mm512_set1_ps(-32.f));
    return;
  }
  s1 = s0;
  b1 = b0;
}

// Quads 0-3 of q against the four quads of activations at xq: 16 int32 sums, one per row. Each quad of x is
// broadcast straight from memory (a load, not a move from a general register and a shuffle).
MINISGL_TQ inline __m512i xquad(const int8_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }
MINISGL_TQ inline __m512i dot4(const __m512i* q, const int8_t* xq) {
  __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], xquad(xq));
  d = _mm512_dpbusd_epi32(d, q[1], xquad(xq + 4));
  d = _mm512_dpbusd_epi32(d, q[2], xquad(xq + 8));
  return _mm512_dpbusd_epi32(d, q[3], xquad(xq + 12));
}

// 16 fp32 outputs into row m of y, at columns col..col+15 (bf16 rounded to nearest even, as c10 does).
MINISGL_TQ inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd), 16);
}
MINISGL_TQ inline void store16(const YOut& y, int64_t m, int64_t col, __m512 v) {
  if (y.b) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y.b + m * y.ys + col), _mm512_cvtepi32_epi16(bf16_bits(v)));
  } else {
    if (y.rounded) v = _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
    _mm512_storeu_ps(y.f + m * y.ys + col, v);
  }
}

// y[m0 .. m0 + MC, col .. col + 15] for one format T and one group of 16 weight rows at g (MC: a compile-time
// count, so that the accumulators stay in registers).
template <int64_t T, int MC>
MINISGL_TQ void group_vnni(const uint8_t* g, int64_t K, const QAct& a, int64_t m0, const float* bias, const YOut& y,
                           int64_t col) {
  const int64_t nb = K / 32;
  __m512 acc[MC];
  for (int i = 0; i < MC; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < nb; ++j) {
    prefetch_block_ahead<T>(g, j);
    __m512i q[8];
    __m512 s0, b0, s1, b1;
    block_of<T>(g, j, q, s0, b0, s1, b1);
    for (int i = 0; i < MC; ++i) {
      const int64_t m = m0 + i;
      const int8_t* xq = a.q(m) + j * 32;
      const __m512i lo = dot4(q, xq), hi = dot4(q + 4, xq + 16);
      const __m512 dx = _mm512_set1_ps(a.d32[m * nb + j]);
      if constexpr (T == Q8_0 || T == I8) {
        // The signed quants were read as q + 128: 128 * sum(q8) comes off in integers, so the one fp32 step rounds
        // sum(q * q8) itself, the AVX2 body's sum (in fp32, the offset of a block of small quants could be 100
        // times its value, and cancelling it lost 7 bits).
        const __m512i d = _mm512_sub_epi32(_mm512_add_epi32(lo, hi), _mm512_set1_epi32(128 * a.i32[m * nb + j]));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s0, dx), acc[i]);
      } else if constexpr (T == Q6_K) {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s0, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s1, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(b0, _mm512_set1_ps(a.s16[(m * nb + j) * 2]), acc[i]);
        acc[i] = _mm512_fmadd_ps(b1, _mm512_set1_ps(a.s16[(m * nb + j) * 2 + 1]), acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(s0, dx), acc[i]);
        acc[i] = _mm512_fmadd_ps(b0, _mm512_set1_ps(a.s32[m * nb + j]), acc[i]);
      }
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int i = 0; i < MC; ++i) store16(y, m0 + i, col, _mm512_add_ps(acc[i], bv));
}

using GroupFn = void (*)(const uint8_t*, int64_t, const QAct&, int64_t, const float*, const YOut&, int64_t);

template <int64_t T>
GroupFn groups_for_count(int mc) {
  static constexpr GroupFn fns[kMC] = {group_vnni<T, 1>, group_vnni<T, 2>, group_vnni<T, 3>, group_vnni<T, 4>,
                                       group_vnni<T, 5>, group_vnni<T, 6>, group_vnni<T, 7>, group_vnni<T, 8>};
  return fns[mc - 1];
}

GroupFn vnni_group(int64_t t, int mc) {
  switch (t) {
    case Q4_0: return groups_for_count<Q4_0>(mc);
    case Q4_1: return groups_for_count<Q4_1>(mc);
    case Q5_0: return groups_for_count<Q5_0>(mc);
    case Q5_1: return groups_for_count<Q5_1>(mc);
    case Q8_0: return groups_for_count<Q8_0>(mc);
    case Q4_K: return groups_for_count<Q4_K>(mc);
    case Q5_K: return groups_for_count<Q5_K>(mc);
    case Q6_K: return groups_for_count<Q6_K>(mc);
    case I8: return groups_for_count<I8>(mc);
    default: return nullptr;
  }
}
// ---------------------------------------------------------------- AVX2: the same kernel, 8 rows at a time
// Without AVX512-VNNI (AMD's Zen 2 and 3, Intel before Ice Lake; MINISGL_CPU_ISA=avx2 on a wider CPU) u . q8 takes
// two steps, llama.cpp's: `vpmaddubsw` multiplies unsigned by signed bytes and adds pairs into int16, and `vpmaddwd`
// by ones adds pairs of those into int32. A 32-byte register is half a chunk (rows 0-7, or 8-15), so a group of 16
// rows runs as two halves, each over the whole row (the second half's bytes are in L1 by then). An int16 saturates at
// 32767, and a pair of products is at most 2 * 127 * u_max: with 4-bit quants all 8 quads of a block add up in int16
// before widening (8 * 3810 = 30480), with 5-bit 4 quads (31496), with 6-bit 2 (32004); Q8_0's and I8's signed quants
// take the sign trick (|q| times x with q's sign) one quad at a time, and need no offset. The fp32 steps are the VNNI
// kernel's, in its order, so that the two give the same bits (for Q8_0 and I8, the VNNI body takes its offset off in
// integers).
#define MINISGL_T2 __attribute__((target("avx2,fma,f16c")))

constexpr int kMC2 = 4;   // rows of x per half block: 8 quads + 4 accumulators + scales fit the 16 ymm registers

MINISGL_T2 inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
MINISGL_T2 inline __m256 f16x8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
MINISGL_T2 inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
MINISGL_T2 inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
MINISGL_T2 inline __m256i low4_2(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
MINISGL_T2 inline __m256i high4_2(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

constexpr bool signed_quants(int64_t t) { return t == Q8_0 || t == I8; }

// block_of for rows 8 hv .. 8 hv + 7 of the group: byte offsets + 32 hv in a chunk, + 16 hv in a [16] fp16 array,
// + 8 hv in a [16] byte array. Q8_0's and I8's quants stay signed (b0, b1 unused).
template <int64_t T>
MINISGL_T2 inline void half_block_of(const uint8_t* g, int64_t j, int hv, __m256i q[8], __m256& s0, __m256& b0,
                                     __m256& s1, __m256& b1) {
  const int64_t s = j / 8, jj = j % 8, o = 32 * hv;
  if constexpr (T == Q4_0 || T == Q4_1) {
    const uint8_t* rec = g + j * (T == Q4_0 ? kRec40 : kRec41);
    const uint8_t* qs = rec + (T == Q4_0 ? 32 : 64) + o;
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load32(qs + 64 * i);
      q[i] = low4_2(v);
      q[i + 4] = high4_2(v);
    }
    s0 = f16x8(rec + 16 * hv);
    b0 = T == Q4_0 ? _mm256_mul_ps(s0, _mm256_set1_ps(-8.f)) : f16x8(rec + 32 + 16 * hv);
  } else if constexpr (T == Q5_0 || T == Q5_1) {
    const uint8_t* rec = g + j * (T == Q5_0 ? kRec50 : kRec51);
    const uint8_t* qh = rec + (T == Q5_0 ? 32 : 64) + o;
    const __m256i h = load32(qh), bit4 = _mm256_set1_epi8(0x10);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = load32(qh + 64 + 64 * i);
      q[i] = low4_2(v);
      q[i + 4] = high4_2(v);
    }
    for (int c = 0; c < 8; ++c) {   // bit c of each byte, moved to bit 4
      const __m256i t = c < 4 ? _mm256_slli_epi16(h, 4 - c) : c > 4 ? _mm256_srli_epi16(h, c - 4) : h;
      q[c] = _mm256_or_si256(q[c], _mm256_and_si256(t, bit4));
    }
    s0 = f16x8(rec + 16 * hv);
    b0 = T == Q5_0 ? _mm256_mul_ps(s0, _mm256_set1_ps(-16.f)) : f16x8(rec + 32 + 16 * hv);
  } else if constexpr (T == Q8_0 || T == I8) {
    const uint8_t* qs = (T == Q8_0 ? g + j * kRec80 + 32 : g + 64 + j * 512) + o;
    for (int c = 0; c < 8; ++c) q[c] = load32(qs + 64 * c);
    s0 = T == Q8_0 ? f16x8(g + j * kRec80 + 16 * hv) : _mm256_loadu_ps(reinterpret_cast<const float*>(g) + 8 * hv);
    b0 = _mm256_setzero_ps();
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* rec = g + s * (T == Q4_K ? kRec4K : kRec5K);
    const uint8_t* qs = rec + (T == Q4_K ? 320 : 832) + (jj / 2) * 512 + o;
    for (int c = 0; c < 8; ++c) {
      const __m256i v = load32(qs + 64 * c);
      q[c] = jj % 2 ? high4_2(v) : low4_2(v);
      if constexpr (T == Q5_K) {   // bit jj of each qh byte, moved to bit 4
        const __m256i h = _mm256_and_si256(_mm256_srli_epi16(load32(rec + 320 + 64 * c + o), static_cast<int>(jj)),
                                           _mm256_set1_epi8(1));
        q[c] = _mm256_or_si256(q[c], _mm256_slli_epi16(h, 4));
      }
    }
    s0 = _mm256_mul_ps(f16x8(rec + 16 * hv), u8x8(rec + 64 + 16 * jj + 8 * hv));
    b0 = _mm256_mul_ps(f16x8(rec + 32 + 16 * hv), _mm256_sub_ps(_mm256_setzero_ps(), u8x8(rec + 192 + 16 * jj + 8 * hv)));
  } else {   // Q6_K
    const uint8_t* rec = g + s * kRec6K;
    const int h = static_cast<int>(jj / 4), tq = static_cast<int>(jj % 4);
    const uint8_t* half = rec + 288 + 1536 * h + o;
    for (int c = 0; c < 8; ++c) {
      const __m256i v = load32(half + (8 * (tq & 1) + c) * 64);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(load32(half + 1024 + 64 * c), 2 * tq), _mm256_set1_epi8(3));
      q[c] = _mm256_or_si256(tq >> 1 ? high4_2(v) : low4_2(v), _mm256_slli_epi16(hi, 4));
    }
    const __m256 d = f16x8(rec + 16 * hv);
    const int sub = 8 * h + 2 * tq;
    s0 = _mm256_mul_ps(d, i8x8(rec + 32 + 16 * sub + 8 * hv));
    s1 = _mm256_mul_ps(d, i8x8(rec + 32 + 16 * (sub + 1) + 8 * hv));
    b0 = _mm256_mul_ps(s0, _mm256_set1_ps(-32.f));
    b1 = _mm256_mul_ps(s1, _mm256_set1_ps(-32.f));
    return;
  }
  s1 = s0;
  b1 = b0;
}

MINISGL_T2 inline __m256i xquad2(const int8_t* p) {
  int v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Quads [c0, c0 + N) of q against x's: 8 int32 sums, one per row; PER quads share an int16 sum before widening.
template <int N, int PER>
MINISGL_T2 inline __m256i dots2(const __m256i* q, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int c0 = 0; c0 < N; c0 += PER) {
    __m256i s = _mm256_maddubs_epi16(q[c0], xquad2(xq + 4 * c0));
    for (int c = c0 + 1; c < c0 + PER; ++c) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(q[c], xquad2(xq + 4 * c)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s, ones));
  }
  return acc;
}
MINISGL_T2 inline __m256i dots2_signed(const __m256i* q, const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(q[c]), _mm256_sign_epi8(xquad2(xq + 4 * c), q[c]));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  return acc;
}

MINISGL_T2 inline __m256i bf16_bits2(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
}
MINISGL_T2 inline void store8(const YOut& y, int64_t m, int64_t col, __m256 v) {
  if (y.b) {
    const __m256i b = bf16_bits2(v);   // < 65536: packus keeps them; 64-bit lanes 0 and 2 hold the 8 results
    const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y.b + m * y.ys + col), _mm256_castsi256_si128(p));
  } else {
    if (y.rounded) v = _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits2(v), 16));
    _mm256_storeu_ps(y.f + m * y.ys + col, v);
  }
}

// With one or two rows of x (a decode step of one or two requests) the registers hold both halves' sums, and each
// block of the group is read for rows 0-7, then at once for rows 8-15: the group streams from memory in one pass,
// with no second pass over it from the caches while no weight is read. More rows of x make two passes, as above.
// Either way each sum takes the same steps in the same order: the same bits.
template <int64_t T, int MC>
MINISGL_T2 void group_avx2(const uint8_t* g, int64_t K, const QAct& a, int64_t m0, const float* bias, const YOut& y,
                           int64_t col) {
  const int64_t nb = K / 32;
  constexpr int HV = MC <= 2 ? 2 : 1;   // halves per pass
  for (int h0 = 0; h0 < 2; h0 += HV) {
    __m256 acc[HV][MC];
    for (int hh = 0; hh < HV; ++hh)
      for (int i = 0; i < MC; ++i) acc[hh][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb; ++j) {
      if constexpr (HV == 2) prefetch_block_ahead_avx2<T>(g, j);
      else if (h0 == 0) prefetch_block_ahead<T>(g, j);   // a second pass reads the group from the caches
      for (int hh = 0; hh < HV; ++hh) {
        __m256i q[8];
        __m256 s0, b0, s1, b1;
        half_block_of<T>(g, j, h0 + hh, q, s0, b0, s1, b1);
        for (int i = 0; i < MC; ++i) {
          const int64_t m = m0 + i;
          const int8_t* xq = a.q(m) + j * 32;
          const __m256 dx = _mm256_set1_ps(a.d32[m * nb + j]);
          __m256& ac = acc[hh][i];
          if constexpr (signed_quants(T)) {
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots2_signed(q, xq)), _mm256_mul_ps(s0, dx), ac);
          } else if constexpr (T == Q6_K) {
            const __m256i lo = dots2<4, 2>(q, xq), hi = dots2<4, 2>(q + 4, xq + 16);
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s0, dx), ac);
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s1, dx), ac);
            ac = _mm256_fmadd_ps(b0, _mm256_set1_ps(a.s16[(m * nb + j) * 2]), ac);
            ac = _mm256_fmadd_ps(b1, _mm256_set1_ps(a.s16[(m * nb + j) * 2 + 1]), ac);
          } else {
            constexpr bool four = T == Q4_0 || T == Q4_1 || T == Q4_K;
            const __m256i d = four ? dots2<8, 8>(q, xq) : dots2<8, 4>(q, xq);
            ac = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(s0, dx), ac);
            ac = _mm256_fmadd_ps(b0, _mm256_set1_ps(a.s32[m * nb + j]), ac);
          }
        }
      }
    }
    for (int hh = 0; hh < HV; ++hh) {
      const int hv = h0 + hh;
      const __m256 bv = bias ? _mm256_loadu_ps(bias + 8 * hv) : _mm256_setzero_ps();
      for (int i = 0; i < MC; ++i) store8(y, m0 + i, col + 8 * hv, _mm256_add_ps(acc[hh][i], bv));
    }
  }
}

template <int64_t T>
GroupFn groups2_for_count(int mc) {
  static constexpr GroupFn fns[kMC2] = {group_avx2<T, 1>, group_avx2<T, 2>, group_avx2<T, 3>, group_avx2<T, 4>};
  return fns[mc - 1];
}

GroupFn avx2_group(int64_t t, int mc) {
  switch (t) {
    case Q4_0: return groups2_for_count<Q4_0>(mc);
    case Q4_1: return groups2_for_count<Q4_1>(mc);
    case Q5_0: return groups2_for_count<Q5_0>(mc);
    case Q5_1: return groups2_for_count<Q5_1>(mc);
    case Q8_0: return groups2_for_count<Q8_0>(mc);
    case Q4_K: return groups2_for_count<Q4_K>(mc);
    case Q5_K: return groups2_for_count<Q5_K>(mc);
    case Q6_K: return groups2_for_count<Q6_K>(mc);
    case I8: return groups2_for_count<I8>(mc);
    default: return nullptr;
  }
}
#endif


void check_weight(const at::Tensor& w, int64_t t, int64_t K, const char* fn) {
  TORCH_CHECK(w.device().is_cpu(), fn, ": weights must be on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), fn,
              ": a quantized weight is a contiguous uint8 [N, row_bytes] tensor, got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t rb = row_bytes(t, K);
  TORCH_CHECK(rb > 0, fn, ": type ", t, " cannot hold rows of K=", K,
              " (K-quants need K % 256 == 0, the others K % 64 == 0; types: 2 3 6 7 8 12 13 14 100)");
  TORCH_CHECK(w.size(1) == rb, fn, ": rows of type ", t, " with K=", K, " are ", rb, " bytes, got ", w.size(1));
  TORCH_CHECK(w.size(0) % 16 == 0, fn, ": a quantized weight holds its rows in groups of 16 (repack), got ", w.size(0),
              " rows");
}


// ---------------------------------------------------------------- AMX: dequantize a tile, multiply in bf16
// For batches: a block of 32 weights of 16 rows is dequantized into a bf16 tile (B: 16 pairs of weights x 16 rows),
// and `tdpbf16ps` multiplies up to four tiles of x (A: 16 rows of x x 32 bf16, read from x as it is) with it into
// 16 rows of x x 16 outputs of fp32 sums. The activations are not quantized: the result is the dequantizing path's,
// computed without writing the bf16 weight anywhere but the thread's buffer. The interleaved layout is what the B
// tile wants: lane r of a quad is row r's weights 4c..4c+3, i.e. pairs 2c and 2c + 1 of B's column r.
#if defined(MINISGL_Q_X86) && defined(__linux__)
#define MINISGL_QAMX 1
#define MINISGL_TQA \
  __attribute__((target(MINISGL_AMX_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")))

// Block j of the group at g as bf16 B-tile rows: out[p][2r + e] = w[row r][32 j + 2 p + e].
template <int64_t T>
MINISGL_TQA inline void dequant_block_bf16(const uint8_t* g, int64_t j, uint16_t (*out)[32]) {
  __m512i q[8];
  __m512 s0, b0, s1, b1;
  block_of<T>(g, j, q, s0, b0, s1, b1);
  alignas(64) int16_t pairs[32];   // element 2r + e of a B row: element r of the first vector, then of the second
  for (int r = 0; r < 16; ++r) { pairs[2 * r] = static_cast<int16_t>(r); pairs[2 * r + 1] = static_cast<int16_t>(16 + r); }
  const __m512i interleave = _mm512_load_si512(pairs);
  for (int c = 0; c < 8; ++c) {
    const __m512 s = c < 4 ? s0 : s1, b = c < 4 ? b0 : b1;
    __m512 v[4];
    for (int e = 0; e < 4; ++e) {   // byte e of every lane: weight 4c + e of each row, exact in fp32 (one rounding)
      const __m512i u = _mm512_and_si512(_mm512_srli_epi32(q[c], 8 * e), _mm512_set1_epi32(255));
      v[e] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), s, b);
    }
    _mm512_storeu_si512(out[2 * c], _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0])));
    _mm512_storeu_si512(out[2 * c + 1], _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(v[3], v[2])));
  }
}

#define MINISGL_TILE_I(op, i, ...) \
  switch (i) { case 0: op(0, ##__VA_ARGS__); break; case 1: op(1, ##__VA_ARGS__); break; \
               case 2: op(2, ##__VA_ARGS__); break; default: op(3, ##__VA_ARGS__); break; }
#define MINISGL_ZERO(t) _tile_zero(t)
#define MINISGL_DP(t) _tile_dpbf16ps(t, 6, 4)
#define MINISGL_STORE(t, p) _tile_stored(t, p, 64)

// Rows [n0, n1) (whole groups of 16) of one part for every row of x: a group's blocks are dequantized once into the
// thread's buffer, then every chunk of 64 rows of x runs over them.
template <int64_t T>
MINISGL_TQA void rows_amx(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, const QAct& a,
                          const float* bias, const YOut& y, int64_t col0) {
  amx_tiles_16x64();
  const int64_t nb = K / 32, chunks = (a.M + 15) / 16;
  static thread_local std::vector<uint16_t> tiles;   // the group's blocks as B tiles, [nb][16][32]
  if (static_cast<int64_t>(tiles.size()) < nb * 512 + 32) tiles.resize(nb * 512 + 32);
  auto* bt = reinterpret_cast<uint16_t (*)[16][32]>(tiles.data() + (64 - reinterpret_cast<uintptr_t>(tiles.data()) % 64) / 2);
  alignas(64) float c[4][16][16];
  for (int64_t n = n0; n < n1; n += 16) {
    const uint8_t* g = w + n * rb;
    for (int64_t j = 0; j < nb; ++j) dequant_block_bf16<T>(g, j, bt[j]);
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n) : _mm512_setzero_ps();
    for (int64_t cg = 0; cg < chunks; cg += 4) {
      const int ncg = static_cast<int>(std::min<int64_t>(4, chunks - cg));
      for (int i = 0; i < ncg; ++i) { MINISGL_TILE_I(MINISGL_ZERO, i) }
      for (int64_t j = 0; j < nb; ++j) {
        _tile_loadd(4, bt[j], 64);
        for (int i = 0; i < ncg; ++i) {
          _tile_loadd(6, a.xpad.data() + (cg + i) * 16 * K + j * 32, 2 * K);
          MINISGL_TILE_I(MINISGL_DP, i)
        }
      }
      for (int i = 0; i < ncg; ++i) { MINISGL_TILE_I(MINISGL_STORE, i, c[i]) }
      for (int i = 0; i < ncg; ++i)
        for (int mm = 0; mm < 16; ++mm) {
          const int64_t m = (cg + i) * 16 + mm;
          if (m >= a.M) break;
          store16(y, m, col0 + n, _mm512_add_ps(_mm512_load_ps(c[i][mm]), bv));
        }
    }
  }
}

using AmxRowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const QAct&, const float*, const YOut&,
                           int64_t);
AmxRowsFn amx_rows(int64_t t) {
  switch (t) {
    case Q4_0: return rows_amx<Q4_0>;
    case Q4_1: return rows_amx<Q4_1>;
    case Q5_0: return rows_amx<Q5_0>;
    case Q5_1: return rows_amx<Q5_1>;
    case Q8_0: return rows_amx<Q8_0>;
    case Q4_K: return rows_amx<Q4_K>;
    case Q5_K: return rows_amx<Q5_K>;
    case Q6_K: return rows_amx<Q6_K>;
    case I8: return rows_amx<I8>;
    default: return nullptr;
  }
}
#endif

// Rows [r0, r1) of one part (whole groups of 16), for every row of x: each group of 16 weight rows is read by every
// chunk of 8 rows of x while it is in L1.
void part_rows(const QuantPlan& p, const QuantPlan::Part& pt, int64_t r0, int64_t r1, const QAct& a, const float* xf,
               const YOut& out) {
  const float* bias = p.bias ? p.bias + pt.start : nullptr;
#ifdef MINISGL_QAMX
  if (p.amx) { amx_rows(pt.qtype)(pt.w, pt.rb, p.K, r0, r1, a, bias, out, pt.start); return; }
#endif
  if (!p.q8) { rows_portable(pt.qtype, pt.w, pt.rb, p.K, r0, r1, xf, a.M, bias, out, pt.start); return; }
#ifdef MINISGL_Q_X86
  const bool vnni = q8_isa_here() == Q8Isa::vnni;
  const int64_t mc_max = vnni ? kMC : kMC2;
  for (int64_t n = r0; n < r1; n += 16)
    for (int64_t m0 = 0; m0 < a.M; m0 += mc_max) {
      const int mc = static_cast<int>(std::min<int64_t>(mc_max, a.M - m0));
      (vnni ? vnni_group : avx2_group)(pt.qtype, mc)(pt.w + n * pt.rb, p.K, a, m0, bias ? bias + n : nullptr, out,
                                                     pt.start + n);
    }
#endif
}

}  // namespace

// Which body of the int8 kernel runs here: AVX512-VNNI, AVX2, or none (the portable fallback).
Q8Isa q8_isa_here() {
#ifdef MINISGL_Q_X86
  static const Q8Isa isa = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("f16c")) return Q8Isa::none;
    if (best_isa() >= Isa::avx512 && __builtin_cpu_supports("avx512vnni")) return Q8Isa::vnni;
    return best_isa() >= Isa::avx2 ? Q8Isa::avx2 : Q8Isa::none;
  }();
  return isa;
#else
  return Q8Isa::none;
#endif
}

void QAct::reset(int64_t m, int64_t k) {
  M = m; K = k; Kp = (k + 63) / 64 * 64;
  if (static_cast<int64_t>(q8.size()) < M * Kp + 64) q8.resize(M * Kp + 64);
  q8_off = (64 - reinterpret_cast<uintptr_t>(q8.data()) % 64) % 64;
  d32.resize(M * (K / 32));
  s32.resize(M * (K / 32));
  i32.resize(M * (K / 32));
  s16.resize(M * (K / 16));
}
void QAct::reset_packed(int64_t m, int64_t k) {
  M = m; K = k;
  xpad.assign(((m + 15) / 16) * 16 * k, 0u);
}

void QAct::pack_rows(const uint16_t* x, int64_t xs, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) std::memcpy(xpad.data() + m * K, x + m * xs, K * sizeof(uint16_t));
}

bool quant_amx_here() {
#if defined(MINISGL_QAMX)
  return amx_available();   // the tests' emulated build: true on any CPU (gemm_amx.cpp)
#else
  return false;
#endif
}

void QAct::quantize_rows(const float* x, int64_t xs, int64_t m0, int64_t m1) {
  if (q8_isa_here() == Q8Isa::vnni) quantize_rows_of(*this, x, xs, m0, m1);
  else quantize_rows_avx2(*this, x, xs, m0, m1);
}
void QAct::quantize_rows(const uint16_t* x, int64_t xs, int64_t m0, int64_t m1) {
  if (q8_isa_here() == Q8Isa::vnni) quantize_rows_of(*this, x, xs, m0, m1);
  else quantize_rows_avx2(*this, x, xs, m0, m1);
}

QuantPlan make_quant_plan(const std::vector<at::Tensor>& weights, const std::vector<int64_t>& qtypes, int64_t K,
                          const float* bias, int64_t nparts) {
  TORCH_CHECK(!weights.empty() && weights.size() == qtypes.size(), "quant_linear: one type per weight part");
  QuantPlan p;
  p.K = K;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], qtypes[i], K, "quant_linear");
    p.parts.push_back({weights[i].data_ptr<uint8_t>(), qtypes[i], weights[i].size(0), weights[i].size(1), p.N});
    p.N += weights[i].size(0);
  }
  p.bias = bias;
  p.q8 = q8_isa_here() != Q8Isa::none;
  p.nparts = std::max<int64_t>(1, std::min<int64_t>(nparts, (p.N + 15) / 16));
  p.per = ((p.N + p.nparts - 1) / p.nparts + 15) / 16 * 16;   // whole blocks of 16 rows
  p.nparts = (p.N + p.per - 1) / p.per;
  return p;
}

void run_quant_part(const QuantPlan& p, const QAct& a, const float* xf, int64_t part, void* y, int64_t ys, YFormat yf) {
  YOut out;
  out.ys = ys;
  if (yf == YFormat::bf16) out.b = static_cast<uint16_t*>(y);
  else { out.f = static_cast<float*>(y); out.rounded = yf == YFormat::f32_bf16_rounded; }
  const int64_t n0 = part * p.per, n1 = std::min(p.N, n0 + p.per);
  for (const auto& pt : p.parts) {   // a range may span two parts
    const int64_t r0 = std::max(n0, pt.start), r1 = std::min(n1, pt.start + pt.rows);
    if (r0 < r1) part_rows(p, pt, r0 - pt.start, r1 - pt.start, a, xf, out);
  }
}

}  // namespace cpu

int64_t quant_row_bytes(int64_t qtype, int64_t K) { return cpu::row_bytes(qtype, K); }

std::string quant_q8dot_isa() {
  switch (cpu::q8_isa_here()) {
    case cpu::Q8Isa::vnni: return "avx512-vnni";
    case cpu::Q8Isa::avx2: return "avx2";
    default: return "";
  }
}

at::Tensor quant_dequantize_cpu(const at::Tensor& w, int64_t qtype, int64_t K, const c10::optional<at::Tensor>& rows) {
  cpu::check_weight(w, qtype, K, "quant_dequantize");
  const int64_t rb = w.size(1);
  at::Tensor idx;
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong || rows->scalar_type() == at::kInt, "quant_dequantize: rows must be int");
    idx = rows->reshape({-1}).to(at::kLong).contiguous();
    const int64_t* ip = idx.data_ptr<int64_t>();   // a loop: idx.min() and idx.max() cost more than a decode step's rows
    for (int64_t i = 0; i < idx.numel(); ++i)
      TORCH_CHECK(ip[i] >= 0 && ip[i] < w.size(0), "quant_dequantize: rows out of range [0, ", w.size(0), "), got ", ip[i]);
  }
  const int64_t n = rows ? idx.numel() : w.size(0);
  at::Tensor y = at::empty({n, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t* ip = rows ? idx.data_ptr<int64_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = ip ? ip[i] : i;
      cpu::dequant_row(qtype, wp + (n / 16) * 16 * rb, static_cast<int>(n % 16), K, yp + i * K);
    }
  });
  return y;
}

// y[M, sum N_p] = x[M, K] @ W^T (+ bias): W given as parts (rows of one output each, in order), each with its type.
// kernel: -1 the best of int8 (VNNI or AVX2) and portable here, 0 the portable path, 1 int8, 2 AMX (bf16 x); checked.
at::Tensor quant_linear_cpu(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                            const std::vector<int64_t>& qtypes, const c10::optional<at::Tensor>& bias, int64_t kernel) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "quant_linear: x must be a 2-D CPU tensor, got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "quant_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const int nt = std::max(1, at::get_num_threads());
  at::Tensor bf;
  if (bias) bf = bias->to(at::kFloat).contiguous();
  cpu::QuantPlan p = cpu::make_quant_plan(weights, qtypes, K, bias ? bf.data_ptr<float>() : nullptr, 4 * nt);
  TORCH_CHECK(!bias || bias->numel() == p.N, "quant_linear: bias must have ", p.N, " entries, got ", bias->numel());
  TORCH_CHECK(kernel != 1 || p.q8, "quant_linear: the int8 kernel (AVX512-VNNI or AVX2) asked for but not available here");
  TORCH_CHECK(kernel != 2 || cpu::quant_amx_here(), "quant_linear: AMX asked for but not available here");
  TORCH_CHECK(kernel != 2 || x.scalar_type() == at::kBFloat16, "quant_linear: the AMX kernel takes bfloat16 x");
  if (kernel == 0) p.q8 = false;
  p.amx = kernel == 2;
  at::Tensor y = at::empty({M, p.N}, x.options());
  if (M == 0 || p.N == 0) return y;
  const at::Tensor xc = x.contiguous();
  static thread_local cpu::QAct act_buf;   // reused: no allocation per call (the calling thread's)
  cpu::QAct& act = act_buf;                // a reference: the worker threads below must read THIS thread's buffer
  act.reset(M, K);
  at::Tensor xf;
  if (p.amx) {
    act.reset_packed(M, K);
    act.pack_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K, 0, M);
  } else if (p.q8) {
    if (x.scalar_type() == at::kFloat) act.quantize_rows(xc.data_ptr<float>(), K, 0, M);
    else act.quantize_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), K, 0, M);
  } else {
    xf = xc.to(at::kFloat).contiguous();
  }
  const cpu::YFormat yf = x.scalar_type() == at::kFloat ? cpu::YFormat::f32 : cpu::YFormat::bf16;
  at::parallel_for(0, p.nparts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      cpu::run_quant_part(p, act, xf.defined() ? xf.data_ptr<float>() : nullptr, t, y.data_ptr(), p.N, yf);
  });
  return y;
}

}  // namespace minisgl
