// quant.cpp -- linears over quantized weights: GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and minisgl's per-channel
// int8 (I8), read as they are stored, 4 to 8 bits a weight.
//
// Every format is a row of blocks of 32 weights w = s * u + b, with u an unsigned integer (0..15, 0..31, 0..63 or
// 0..255: Q8_0's and I8's signed q read as u = q + 128), s a scale and b an offset that the block shares (Q6_K:
// two halves of 16 with their own s and b). The activations are quantized per block of 32 as llama.cpp does
// (q8 = round(x / dx), dx = max|x| / 127), and then one block's dot product is
//     sum(w * x) ~= s * dx * (u . q8) + b * dx * sum(q8)
// where u . q8 is an integer dot product: AVX512-VNNI's `vpdpbusd` (unsigned bytes times signed bytes, four
// products summed into each int32 lane), 64 products an instruction. The error is the activations' rounding only:
// at most dx / 2 per element.
//
// Layout. quant/repack (Python, chapter quant) rewrites each GGUF row into the same bytes (+4 per 256 weights for
// Q4_K and Q5_K, whose 6-bit scales are unpacked) with the scales gathered in front of the quants, so that a
// vector load takes a whole group's scales:
//   Q4_0: d fp16[K/32]                       | qs[K/2]      pairs of blocks: byte l = a[l] | b[l] << 4
//   Q4_1: d fp16[K/32] | m fp16[K/32]         | qs[K/2]      (the same pairs)
//   Q8_0: d fp16[K/32]                       | q int8[K]
//   Q4_K: d fp16[K/256] | dmin fp16[K/256] | sc u8[K/32] | mn u8[K/32] | qs[K/2]            (GGUF's order)
//   Q5_K: d fp16[K/256] | dmin fp16[K/256] | sc u8[K/32] | mn u8[K/32] | qh[K/8] | qs[K/2]  (GGUF's order)
//   Q6_K: d fp16[K/256] | sc int8[K/16] | ql[K/2] | qh[K/4]                                (GGUF's order)
//   I8  : q int8[K] | scale fp32   (per output channel, symmetric: w = scale * q)
// so that one zmm of 64 unpacked bytes is always two consecutive blocks in element order, and the activations
// need no reordering.
//
// Kernels: quant_linear (VNNI) for any number of rows (up to 8 rows of x share each unpacked weight pair in
// registers); a portable fallback that dequantizes a row into fp32 (no VNNI, or MINISGL_CPU_ISA below avx512);
// quant_dequantize, exact, for tests, embedding rows and the layers that want bf16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
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
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, I8 = 100 };

bool is_k_quant(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }

// Bytes of one repacked row of K weights (see the layout above); -1 for an unknown type or a K it cannot hold.
int64_t row_bytes(int64_t t, int64_t K) {
  if (K <= 0) return -1;
  if (is_k_quant(t) && K % 256) return -1;
  if (!is_k_quant(t) && K % 64) return -1;   // blocks are taken in pairs
  const int64_t nb = K / 32, ns = K / 256;
  switch (t) {
    case Q4_0: return nb * 18;
    case Q4_1: return nb * 20;
    case Q8_0: return nb * 34;
    case Q4_K: return ns * 148;
    case Q5_K: return ns * 180;
    case Q6_K: return ns * 210;
    case I8: return K + 4;
    default: return -1;
  }
}

inline float h2f(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

// ---------------------------------------------------------------- exact dequantization (the reference)
// The same fp32 operations, in the same order, as gguf-py's numpy dequantization (products of a fp16 scale and
// small integers are exact in fp32, so contraction into FMAs changes nothing either).
void dequant_row(int64_t t, const uint8_t* r, int64_t K, float* y) {
  const int64_t nb = K / 32, ns = K / 256;
  switch (t) {
    case Q4_0:
    case Q4_1: {
      const uint8_t* qs = r + nb * (t == Q4_0 ? 2 : 4);
      for (int64_t j = 0; j < nb; ++j) {
        const float d = h2f(r + 2 * j), m = t == Q4_1 ? h2f(r + 2 * nb + 2 * j) : 0.f;
        const uint8_t* q = qs + (j / 2) * 32;
        const int shift = (j % 2) * 4;
        for (int l = 0; l < 32; ++l) {
          const int u = (q[l] >> shift) & 15;
          y[j * 32 + l] = t == Q4_0 ? d * static_cast<float>(u - 8) : d * static_cast<float>(u) + m;
        }
      }
      return;
    }
    case Q8_0: {
      const int8_t* q = reinterpret_cast<const int8_t*>(r + 2 * nb);
      for (int64_t j = 0; j < nb; ++j) {
        const float d = h2f(r + 2 * j);
        for (int l = 0; l < 32; ++l) y[j * 32 + l] = d * static_cast<float>(q[j * 32 + l]);
      }
      return;
    }
    case Q4_K:
    case Q5_K: {
      const uint8_t *sc = r + 4 * ns, *mn = sc + nb, *qh = mn + nb;
      const uint8_t* qs = t == Q5_K ? qh + K / 8 : qh;
      for (int64_t g = 0; g < ns; ++g) {
        const float d = h2f(r + 2 * g), dmin = h2f(r + 2 * ns + 2 * g);
        for (int p = 0; p < 4; ++p)
          for (int h = 0; h < 2; ++h) {
            const int64_t j = g * 8 + 2 * p + h;
            const float s = d * static_cast<float>(sc[j]), m = dmin * static_cast<float>(mn[j]);
            for (int l = 0; l < 32; ++l) {
              int u = (qs[g * 128 + p * 32 + l] >> (4 * h)) & 15;
              if (t == Q5_K && (qh[g * 32 + l] >> (2 * p + h) & 1)) u += 16;
              y[j * 32 + l] = s * static_cast<float>(u) - m;
            }
          }
      }
      return;
    }
    case Q6_K: {
      const int8_t* sc = reinterpret_cast<const int8_t*>(r + 2 * ns);
      const uint8_t *ql = r + 2 * ns + K / 16, *qh = ql + K / 2;
      for (int64_t g = 0; g < ns; ++g) {
        const float d = h2f(r + 2 * g);
        for (int h = 0; h < 2; ++h)
          for (int tq = 0; tq < 4; ++tq)
            for (int l = 0; l < 32; ++l) {
              const uint8_t lo = ql[g * 128 + h * 64 + (tq & 1) * 32 + l] >> ((tq >> 1) * 4) & 15;
              const uint8_t hi = qh[g * 64 + h * 32 + l] >> (2 * tq) & 3;
              const int q = (lo | hi << 4) - 32;
              const float s = d * static_cast<float>(sc[g * 16 + h * 8 + 2 * tq + l / 16]);
              y[g * 256 + h * 128 + tq * 32 + l] = s * static_cast<float>(q);
            }
      }
      return;
    }
    case I8: {
      float s;
      std::memcpy(&s, r + K, 4);
      const int8_t* q = reinterpret_cast<const int8_t*>(r);
      for (int64_t k = 0; k < K; ++k) y[k] = s * static_cast<float>(q[k]);
      return;
    }
    default:
      TORCH_CHECK(false, "unknown quantized type ", t);
  }
}

// ---------------------------------------------------------------- activations
template <typename T>
inline float as_f32(T v) { return static_cast<float>(v); }
inline float as_f32(uint16_t v) { return __builtin_bit_cast(float, uint32_t(v) << 16); }

template <typename T>
void quantize_rows_of(QAct& a, const T* x, int64_t xs, int64_t m0, int64_t m1) {
  const int64_t K = a.K, nb = K / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const T* xr = x + m * xs;
    int8_t* q = a.q8.data() + a.q8_off + m * a.Kp;
    for (int64_t j = 0; j < nb; ++j) {
      float v[32], amax = 0.f;
      for (int l = 0; l < 32; ++l) { v[l] = as_f32(xr[j * 32 + l]); amax = std::max(amax, std::fabs(v[l])); }
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int sum[2] = {0, 0};
      for (int l = 0; l < 32; ++l) {
        const int r = static_cast<int>(std::nearbyint(v[l] * id));
        q[j * 32 + l] = static_cast<int8_t>(r);
        sum[l / 16] += r;
      }
      a.s16[(m * nb + j) * 2] = d * static_cast<float>(sum[0]);
      a.s16[(m * nb + j) * 2 + 1] = d * static_cast<float>(sum[1]);
      a.s32[m * nb + j] = d * static_cast<float>(sum[0] + sum[1]);
      float* dp = a.dpair.data() + (m * (K / 64) + j / 2) * 16 + (j % 2) * 8;
      for (int l = 0; l < 8; ++l) dp[l] = d;
    }
  }
}

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
    dequant_row(t, w + n * rb, K, wr.data());
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

constexpr int kMC = 8;   // rows of x that share one unpacked pair of weight blocks

// Lane i of the pair-scale vector of pair p takes element 2p + i / 8 of a group's 8 block scales (or, Q6_K,
// element 4p + i / 4 of its 16 half-block scales).
MINISGL_TQ inline __m512i pair_index(int p, bool halves) {
  alignas(64) int32_t idx[16];
  for (int i = 0; i < 16; ++i) idx[i] = halves ? 4 * p + i / 4 : 2 * p + i / 8;
  return _mm512_load_si512(idx);
}

// 32 bytes -> their low nibbles (bytes 0-31) | their high nibbles (32-63): the 32 bytes loaded into both halves,
// the upper half shifted right by 4 (a per-lane shift count), then masked: three instructions.
MINISGL_TQ inline __m512i nibbles(const uint8_t* q) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512i shift = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
  return _mm512_and_si512(_mm512_srlv_epi64(v, shift), _mm512_set1_epi8(15));
}

// Group g (8 blocks, 256 weights; fewer in the last group) of one row: its block scales and offsets, 8 lanes
// (Q6_K: 16 halves of 16), zero past the group's blocks. I8: the row's scale is left to the caller (s = 1).
template <int64_t T>
MINISGL_TQ inline void group_scales(const uint8_t* r, int64_t K, int64_t g, int nbg, __m512& sv, __m512& bv) {
  const int64_t nb = K / 32, ns = K / 256;
  const __mmask16 m8 = static_cast<__mmask16>((1u << nbg) - 1);
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q8_0) {
    const __m256i dh = _mm256_maskz_loadu_epi16(m8, r + 2 * g * 8);
    sv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_castsi256_si128(dh)));
    if constexpr (T == Q4_1) {
      const __m256i mh = _mm256_maskz_loadu_epi16(m8, r + 2 * nb + 2 * g * 8);
      bv = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm256_castsi256_si128(mh)));
    } else {
      bv = _mm512_mul_ps(sv, _mm512_set1_ps(T == Q4_0 ? -8.f : -128.f));
    }
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const __m512 d = _mm512_set1_ps(h2f(r + 2 * g)), dmin = _mm512_set1_ps(-h2f(r + 2 * ns + 2 * g));
    const uint8_t* sc = r + 4 * ns + g * 8;
    const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc));
    const __m128i n8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + nb));
    sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s8)));
    bv = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(n8)));
  } else if constexpr (T == Q6_K) {
    const __m512 d = _mm512_set1_ps(h2f(r + 2 * g));
    const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 2 * ns + g * 16));
    sv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s16)));
    bv = _mm512_mul_ps(sv, _mm512_set1_ps(-32.f));
  } else {
    sv = _mm512_set1_ps(1.f);
    bv = _mm512_set1_ps(-128.f);
  }
  if constexpr (T != Q6_K) { sv = _mm512_maskz_mov_ps(m8, sv); bv = _mm512_maskz_mov_ps(m8, bv); }
}

// The 64 unsigned quants of pair p (blocks 2p and 2p + 1) of group g of one row, in element order.
template <int64_t T>
MINISGL_TQ inline __m512i pair_quants(const uint8_t* r, int64_t K, int64_t g, int p) {
  const int64_t nb = K / 32, ns = K / 256;
  if constexpr (T == Q4_0 || T == Q4_1) {
    return nibbles(r + nb * (T == Q4_0 ? 2 : 4) + (g * 4 + p) * 32);
  } else if constexpr (T == Q8_0 || T == I8) {
    return _mm512_xor_si512(_mm512_loadu_si512(r + (T == I8 ? 0 : 2 * nb) + (g * 4 + p) * 64),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    __m512i u = nibbles(r + 4 * ns + 2 * nb + (T == Q5_K ? K / 8 : 0) + g * 128 + p * 32);
    if constexpr (T == Q5_K) {   // bit 2p of qh[l]: block 2p's fifth bit, bit 2p + 1: block 2p + 1's
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 4 * ns + 2 * nb + g * 32));
      const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 1), 1);
      const __m512i hb = _mm512_and_si512(_mm512_srl_epi16(qh2, _mm_cvtsi32_si128(2 * p)), _mm512_set1_epi8(1));
      u = _mm512_or_si512(u, _mm512_slli_epi16(hb, 4));
    }
    return u;
  } else {   // Q6_K: pair p is half p / 2, blocks 2 (p % 2) and 2 (p % 2) + 1 of it
    const int h = p / 2, q = p % 2;
    const uint8_t* ql = r + 2 * ns + K / 16 + g * 128 + h * 64;
    const __m256i hv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 2 * ns + K / 16 + K / 2 + g * 64 + h * 32));
    const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(hv), _mm256_srli_epi16(hv, 2), 1);
    const __m512i lo = _mm512_loadu_si512(ql);
    const __m512i nib = _mm512_and_si512(q ? _mm512_srli_epi16(lo, 4) : lo, _mm512_set1_epi8(15));
    const __m512i hi = _mm512_and_si512(q ? _mm512_srli_epi16(qh, 4) : qh, _mm512_set1_epi8(3));
    return _mm512_or_si512(nib, _mm512_slli_epi16(hi, 4));
  }
}

// y[:, n0:n1] for one format T and MC rows of x from m0 (a compile-time count: the accumulators stay in registers).
template <int64_t T, int MC>
MINISGL_TQ void rows_vnni(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, const QAct& a, int64_t m0,
                          const float* bias, const YOut& y, int64_t col0) {
  const int64_t nb = K / 32, ngroups = (K + 255) / 256;
  constexpr bool halves = T == Q6_K;
  __m512i pidx[4];
  for (int p = 0; p < 4; ++p) pidx[p] = pair_index(p, halves);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* r = w + n * rb;
    __m512 acc[MC], accb[MC];
    for (int i = 0; i < MC; ++i) acc[i] = accb[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ngroups; ++g) {
      const int nbg = static_cast<int>(std::min<int64_t>(8, nb - g * 8));   // blocks in this group
      const __mmask16 m8 = static_cast<__mmask16>((1u << nbg) - 1);
      __m512 sv, bv;
      group_scales<T>(r, K, g, nbg, sv, bv);
      // the offsets: b . (dx * sum(q8)) per block (Q6_K: per half)
      for (int i = 0; i < MC; ++i) {
        const __m512 xs = halves ? _mm512_loadu_ps(a.s16.data() + ((m0 + i) * nb + g * 8) * 2)
                                 : _mm512_maskz_loadu_ps(m8, a.s32.data() + (m0 + i) * nb + g * 8);
        accb[i] = _mm512_fmadd_ps(bv, xs, accb[i]);
      }
#pragma GCC unroll 4
      for (int p = 0; p < nbg / 2; ++p) {
        const __m512i u = pair_quants<T>(r, K, g, p);
        const __m512 s = _mm512_permutexvar_ps(pidx[p], sv);
        const int64_t off = g * 256 + p * 64;
        for (int i = 0; i < MC; ++i) {
          const __m512i xq = _mm512_load_si512(a.q(m0 + i) + off);
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, xq);
          const __m512 dx = _mm512_loadu_ps(a.dpair.data() + ((m0 + i) * (K / 64) + off / 64) * 16);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, dx), acc[i]);
        }
      }
    }
    float rs = 1.f;
    if constexpr (T == I8) std::memcpy(&rs, r + K, 4);
    const float b = bias ? bias[n] : 0.f;
    for (int i = 0; i < MC; ++i)
      y.put(m0 + i, col0 + n, rs * _mm512_reduce_add_ps(_mm512_add_ps(acc[i], accb[i])) + b);
  }
}

using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, int64_t, const QAct&, int64_t, const float*,
                        const YOut&, int64_t);

template <int64_t T>
RowsFn rows_for_count(int mc) {
  static constexpr RowsFn fns[kMC] = {rows_vnni<T, 1>, rows_vnni<T, 2>, rows_vnni<T, 3>, rows_vnni<T, 4>,
                                      rows_vnni<T, 5>, rows_vnni<T, 6>, rows_vnni<T, 7>, rows_vnni<T, 8>};
  return fns[mc - 1];
}

RowsFn vnni_rows(int64_t t, int mc) {
  switch (t) {
    case Q4_0: return rows_for_count<Q4_0>(mc);
    case Q4_1: return rows_for_count<Q4_1>(mc);
    case Q8_0: return rows_for_count<Q8_0>(mc);
    case Q4_K: return rows_for_count<Q4_K>(mc);
    case Q5_K: return rows_for_count<Q5_K>(mc);
    case Q6_K: return rows_for_count<Q6_K>(mc);
    case I8: return rows_for_count<I8>(mc);
    default: return nullptr;
  }
}
#endif

bool vnni_here() {
#ifdef MINISGL_Q_X86
  static const bool ok = [] {
    __builtin_cpu_init();
    return best_isa() >= Isa::avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return ok;
#else
  return false;
#endif
}

void check_weight(const at::Tensor& w, int64_t t, int64_t K, const char* fn) {
  TORCH_CHECK(w.device().is_cpu(), fn, ": weights must be on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), fn,
              ": a quantized weight is a contiguous uint8 [N, row_bytes] tensor, got ", w.scalar_type(), " ",
              w.sizes());
  const int64_t rb = row_bytes(t, K);
  TORCH_CHECK(rb > 0, fn, ": type ", t, " cannot hold rows of K=", K,
              " (K-quants need K % 256 == 0, the others K % 64 == 0; types: 2 3 8 12 13 14 100)");
  TORCH_CHECK(w.size(1) == rb, fn, ": rows of type ", t, " with K=", K, " are ", rb, " bytes, got ", w.size(1));
}


// ---------------------------------------------------------------- AMX: dequantize a tile, multiply in bf16
// For batches: 16 weight rows x one block of 32 are dequantized into a bf16 tile (A, 16 x 64 bytes), and
// `tdpbf16ps` multiplies it with up to four tiles of x (B: 16 k-pairs x 16 rows of x, packed once per matmul)
// into 16 outputs x 16 rows of fp32 sums. The activations are not quantized: the result is the dequantizing
// path's, computed without writing the bf16 weight anywhere but L1.
#if defined(MINISGL_Q_X86) && defined(__linux__)
#define MINISGL_QAMX 1
#define MINISGL_TQA __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

// Group g of one row dequantized into bf16, block by block: out[j] (32 bf16 each) for the group's blocks.
// A quarter of a pair's 64 quants (16 elements) takes one block's scale and offset (Q6_K: one half's).
template <int64_t T>
MINISGL_TQA inline void dequant_group_bf16(const uint8_t* r, int64_t K, int64_t g, int nbg, uint16_t (*out)[16][32],
                                           int row) {
  __m512 sv, bv;
  group_scales<T>(r, K, g, nbg, sv, bv);
  if constexpr (T == I8) {
    float rs;
    std::memcpy(&rs, r + K, 4);
    sv = _mm512_mul_ps(sv, _mm512_set1_ps(rs));
    bv = _mm512_mul_ps(bv, _mm512_set1_ps(rs));
  }
  for (int p = 0; p < nbg / 2; ++p) {
    const __m512i u = pair_quants<T>(r, K, g, p);
    __m512 wq[4];
    for (int q = 0; q < 4; ++q) {
      const int lane = T == Q6_K ? 4 * p + q : 2 * p + q / 2;
      const __m512i idx = _mm512_set1_epi32(lane);
      const __m128i qb = q == 0 ? _mm512_extracti32x4_epi32(u, 0) : q == 1 ? _mm512_extracti32x4_epi32(u, 1)
                       : q == 2 ? _mm512_extracti32x4_epi32(u, 2) : _mm512_extracti32x4_epi32(u, 3);
      wq[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qb)), _mm512_permutexvar_ps(idx, sv),
                              _mm512_permutexvar_ps(idx, bv));
    }
    _mm512_storeu_si512(out[2 * p][row], (__m512i)_mm512_cvtne2ps_pbh(wq[1], wq[0]));
    _mm512_storeu_si512(out[2 * p + 1][row], (__m512i)_mm512_cvtne2ps_pbh(wq[3], wq[2]));
  }
}

#define MINISGL_TILE_I(op, i, ...) \
  switch (i) { case 0: op(0, ##__VA_ARGS__); break; case 1: op(1, ##__VA_ARGS__); break; \
               case 2: op(2, ##__VA_ARGS__); break; default: op(3, ##__VA_ARGS__); break; }
#define MINISGL_ZERO(t) _tile_zero(t)
#define MINISGL_DP(t) _tile_dpbf16ps(t, 4, 6)
#define MINISGL_STORE(t, p) _tile_stored(t, p, 64)

template <int64_t T>
MINISGL_TQA void rows_amx(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, const QAct& a,
                          const float* bias, const YOut& y, int64_t col0) {
  amx_tiles_16x64();
  const int64_t nb_k = K / 32, ngroups = (K + 255) / 256, chunks = (a.M + 15) / 16;
  alignas(64) uint16_t abuf[8][16][32];   // a group's 8 blocks of 16 rows, as bf16 tiles
  alignas(64) float c[4][16][16];
  const __m512i gidx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(16));
  for (int64_t nb = n0; nb < n1; nb += 16) {
    const int rows = static_cast<int>(std::min<int64_t>(16, n1 - nb));
    if (rows < 16) std::memset(abuf, 0, sizeof(abuf));
    for (int64_t cg = 0; cg < chunks; cg += 4) {
      const int ncg = static_cast<int>(std::min<int64_t>(4, chunks - cg));
      for (int i = 0; i < ncg; ++i) { MINISGL_TILE_I(MINISGL_ZERO, i) }
      for (int64_t g = 0; g < ngroups; ++g) {
        const int nbg = static_cast<int>(std::min<int64_t>(8, nb_k - g * 8));
        for (int r = 0; r < rows; ++r) dequant_group_bf16<T>(w + (nb + r) * rb, K, g, nbg, abuf, r);
        for (int jj = 0; jj < nbg; ++jj) {
          _tile_loadd(4, abuf[jj], 64);
          for (int i = 0; i < ncg; ++i) {
            _tile_loadd(6, a.xpack.data() + ((cg + i) * nb_k + g * 8 + jj) * 256, 64);
            MINISGL_TILE_I(MINISGL_DP, i)
          }
        }
      }
      for (int i = 0; i < ncg; ++i) { MINISGL_TILE_I(MINISGL_STORE, i, c[i]) }
      const __mmask16 mk = static_cast<__mmask16>(rows == 16 ? 0xffff : (1u << rows) - 1);
      const __m512 bv = bias ? _mm512_maskz_loadu_ps(mk, bias + nb) : _mm512_setzero_ps();
      for (int i = 0; i < ncg; ++i)
        for (int mm = 0; mm < 16; ++mm) {
          const int64_t m = (cg + i) * 16 + mm;
          if (m >= a.M) break;
          __m512 v = _mm512_add_ps(_mm512_i32gather_ps(gidx, &c[i][0][mm], 4), bv);   // column mm: outputs nb..nb+15
          if (y.b) {
            _mm256_mask_storeu_epi16(y.b + m * y.ys + col0 + nb, mk, (__m256i)_mm512_cvtneps_pbh(v));
          } else {
            if (y.rounded) v = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
            _mm512_mask_storeu_ps(y.f + m * y.ys + col0 + nb, mk, v);
          }
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
    case Q8_0: return rows_amx<Q8_0>;
    case Q4_K: return rows_amx<Q4_K>;
    case Q5_K: return rows_amx<Q5_K>;
    case Q6_K: return rows_amx<Q6_K>;
    case I8: return rows_amx<I8>;
    default: return nullptr;
  }
}
#endif

// Rows [r0, r1) of one part, for every row of x: blocks of 16 weight rows, each read by every chunk of 8 rows of x
// while it is in L1.
void part_rows(const QuantPlan& p, const QuantPlan::Part& pt, int64_t r0, int64_t r1, const QAct& a, const float* xf,
               const YOut& out) {
  const float* bias = p.bias ? p.bias + pt.start : nullptr;
#ifdef MINISGL_QAMX
  if (p.amx) { amx_rows(pt.qtype)(pt.w, pt.rb, p.K, r0, r1, a, bias, out, pt.start); return; }
#endif
  if (!p.vnni) { rows_portable(pt.qtype, pt.w, pt.rb, p.K, r0, r1, xf, a.M, bias, out, pt.start); return; }
#ifdef MINISGL_Q_X86
  for (int64_t b0 = r0; b0 < r1; b0 += 16) {
    const int64_t b1 = std::min(b0 + 16, r1);
    for (int64_t m0 = 0; m0 < a.M; m0 += kMC) {
      const int mc = static_cast<int>(std::min<int64_t>(kMC, a.M - m0));
      vnni_rows(pt.qtype, mc)(pt.w, pt.rb, p.K, b0, b1, a, m0, bias, out, pt.start);
    }
  }
#endif
}

}  // namespace

void QAct::reset(int64_t m, int64_t k) {
  M = m; K = k; Kp = (k + 63) / 64 * 64;
  if (static_cast<int64_t>(q8.size()) < M * Kp + 64) q8.resize(M * Kp + 64);
  q8_off = (64 - reinterpret_cast<uintptr_t>(q8.data()) % 64) % 64;
  dpair.resize(M * (K / 64) * 16);
  s32.resize(M * (K / 32));
  s16.resize(M * (K / 16));
}
void QAct::reset_packed(int64_t m, int64_t k) {
  M = m; K = k;
  xpack.assign(((m + 15) / 16) * (k / 32) * 256, 0u);
}

void QAct::pack_rows(const uint16_t* x, int64_t xs, int64_t m0, int64_t m1) {
  const int64_t steps = K / 32;
  for (int64_t m = m0; m < m1; ++m) {
    const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + m * xs);   // bf16 pairs
    uint32_t* base = xpack.data() + (m / 16) * steps * 256 + m % 16;
    for (int64_t kp = 0; kp < K / 2; ++kp) base[(kp / 16) * 256 + (kp % 16) * 16] = xr[kp];
  }
}

bool quant_amx_here() {
#ifdef MINISGL_QAMX
  return amx_available();
#else
  return false;
#endif
}

void QAct::quantize_rows(const float* x, int64_t xs, int64_t m0, int64_t m1) { quantize_rows_of(*this, x, xs, m0, m1); }
void QAct::quantize_rows(const uint16_t* x, int64_t xs, int64_t m0, int64_t m1) { quantize_rows_of(*this, x, xs, m0, m1); }

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
  p.vnni = vnni_here();
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

bool quant_vnni_available() { return cpu::vnni_here(); }

at::Tensor quant_dequantize_cpu(const at::Tensor& w, int64_t qtype, int64_t K, const c10::optional<at::Tensor>& rows) {
  cpu::check_weight(w, qtype, K, "quant_dequantize");
  const int64_t rb = w.size(1);
  at::Tensor idx;
  if (rows) {
    TORCH_CHECK(rows->scalar_type() == at::kLong || rows->scalar_type() == at::kInt, "quant_dequantize: rows must be int");
    idx = rows->reshape({-1}).to(at::kLong).contiguous();
    if (idx.numel()) {
      TORCH_CHECK(idx.min().item<int64_t>() >= 0 && idx.max().item<int64_t>() < w.size(0),
                  "quant_dequantize: rows out of range [0, ", w.size(0), ")");
    }
  }
  const int64_t n = rows ? idx.numel() : w.size(0);
  at::Tensor y = at::empty({n, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t* ip = rows ? idx.data_ptr<int64_t>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) cpu::dequant_row(qtype, wp + (ip ? ip[i] : i) * rb, K, yp + i * K);
  });
  return y;
}

// y[M, sum N_p] = x[M, K] @ W^T (+ bias): W given as parts (rows of one output each, in order), each with its type.
// kernel: -1 the best of VNNI and portable here, 0 the portable path, 1 VNNI, 2 AMX (bf16 x); checked.
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
  TORCH_CHECK(kernel != 1 || p.vnni, "quant_linear: VNNI asked for but not available here");
  TORCH_CHECK(kernel != 2 || cpu::quant_amx_here(), "quant_linear: AMX asked for but not available here");
  TORCH_CHECK(kernel != 2 || x.scalar_type() == at::kBFloat16, "quant_linear: the AMX kernel takes bfloat16 x");
  if (kernel == 0) p.vnni = false;
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
  } else if (p.vnni) {
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
