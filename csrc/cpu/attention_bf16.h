// attention_bf16.h -- the bf16 task bodies of attention.cpp for CPUs with AVX512-BF16 (included there, inside its
// anonymous namespace: Args, Scratch, slot_at, kTileK come from attention.cpp).
//
// The fp32 bodies widen every K/V element to fp32 and multiply-add 16 lanes per instruction. `vdpbf16ps`
// multiplies 32 bf16 pairs into 16 fp32 sums per instruction and needs no widening, so here the caches are read
// as they are and only the softmax stays in fp32. Extend (prefill) only: S = Q K^T with K gathered into the
// pairs layout of the packed linear (csrc/cpu/gemm_bf16.cpp): a 64-byte line holds dims (2p, 2p+1) of 16 keys,
// multiplied by a broadcast pair (q[2p], q[2p+1]); an R x 4 block of accumulators gives 4 rows x 64 keys of
// scores. P is rounded to bf16 (as flash attention does on GPUs) and acc += P V uses V gathered as key pairs: a
// line holds keys (2k, 2k+1) of 16 dims, multiplied by the broadcast pair (p[2k], p[2k+1]). Accumulation is
// fp32 throughout; the scores are scaled in fp32 after the bf16 dot (q stays exact).
// Decode keeps the fp32 bodies here: one query per head makes it a stream over the cache, and a bf16-dot decode body
// (dots of K rows, V rows interleaved into key pairs) measured no faster at contexts 256-4096 on a Zen 5 while
// rounding P. On a CPU with AMX, decode takes attention_amx.h's body instead.
#pragma once
// <immintrin.h> is included at the top of attention.cpp (not here: this file is included inside a namespace).

#define MINISGL_TARGET_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

namespace bf16 {

inline int32_t pair_at(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Word i of lo / hi = (a[i], b[i]) / (a[16 + i], b[16 + i]) for two rows a, b of 32 bf16: key pairs per dim.
MINISGL_TARGET_BF16 inline void interleave(__m512i a, __m512i b, __m512i& lo, __m512i& hi) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  lo = _mm512_permutex2var_epi16(a, _mm512_load_si512(kLo), b);
  hi = _mm512_permutex2var_epi16(a, _mm512_load_si512(kHi), b);
}

inline __mmask32 tail_mask(int n) { return n >= 32 ? ~__mmask32(0) : n <= 0 ? 0 : (__mmask32(1) << n) - 1; }
// Lanes [lo, hi) of 16 (clamped to 0..16).
inline __mmask16 range16(int lo, int hi) { return static_cast<__mmask16>(tail_mask(std::min(hi, 16)) & ~tail_mask(lo)); }

// ---------------------------------------------------------------- extend
// S[r, 16 (c0 + c) + j] = scale * <q_r, k_{16 (c0 + c) + j}> for r < R, c < NC. q: bf16 rows [R][D];
// kp: the K tile as [kTileK / 16][D / 2][16] words (word = dims 2p, 2p + 1 of one key).
template <int R, int NC>
MINISGL_TARGET_BF16 inline void qk_block(const uint16_t* q, int D, const uint32_t* kp, int c0, float scale, float* S) {
  const int D2 = D / 2;
  __m512 acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int p = 0; p < D2; ++p) {
    __m512bh k[NC];
    for (int c = 0; c < NC; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kp + ((c0 + c) * D2 + p) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair_at(q + r * D + 2 * p));
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, k[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(S + r * kTileK + (c0 + c) * 16, _mm512_mul_ps(acc[r][c], sc));
}

template <int R>
MINISGL_TARGET_BF16 inline void qk_rows(const uint16_t* q, int D, const uint32_t* kp, int c0, int c1, float scale,
                                        float* S) {
  switch (c1 - c0) {
    case 1: return qk_block<R, 1>(q, D, kp, c0, scale, S);
    case 2: return qk_block<R, 2>(q, D, kp, c0, scale, S);
    case 3: return qk_block<R, 3>(q, D, kp, c0, scale, S);
    default: return qk_block<R, 4>(q, D, kp, c0, scale, S);
  }
}

// acc[r, d0 .. d0 + 64) += sum over key pairs k in [k0, k1) of P[r, 2k .. 2k + 1] . V[2k .. 2k + 1, d0 .. d0 + 64)
// for r < R. P: bf16 [R][kTileK]; vp: the V tile as [kTileK / 2][Dp] words (word = keys 2k, 2k + 1 of one dim).
template <int R>
MINISGL_TARGET_BF16 inline void pv_block(const uint16_t* P, const uint32_t* vp, int Dp, int k0, int k1, int d0,
                                         float* acc) {
  __m512 o[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) o[r][c] = _mm512_loadu_ps(acc + r * Dp + d0 + 16 * c);
  for (int k = k0; k < k1; ++k) {
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vp + k * Dp + d0 + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh pv = (__m512bh)_mm512_set1_epi32(pair_at(P + r * kTileK + 2 * k));
      for (int c = 0; c < 4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pv, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * Dp + d0 + 16 * c, o[r][c]);
}

// ---------------------------------------------------------------- what both extend bodies (this one, attention_amx.h) share
// The task's G heads x nq queries as bf16 rows of qb [M][D], and their softmax state cleared.
MINISGL_TARGET_BF16 inline void start_rows(const Args& a, int64_t q_begin, int64_t i0, int nq, int64_t h, int Dp,
                                           uint16_t* qb, float* acc, float* m, float* l) {
  const int D = static_cast<int>(a.D), G = static_cast<int>(a.G), M = nq * G;
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g)
      std::memcpy(qb + (i * G + g) * D, q + (q_begin + i0 + i) * a.q_s0 + (h * G + g) * a.q_s1, 2 * D);
  std::fill(acc, acc + M * Dp, 0.f);
  std::fill(m, m + M, kNegInf);
  std::fill(l, l + M, 0.f);
}

// The keys [jlo[r], jhi[r]) of the tile of n keys from t0 that row r = (query i, head g) sees; query i is at
// position p_first + i.
MINISGL_TARGET_BF16 inline void visible_keys(const Args& a, int64_t p_first, int64_t t0, int n, int nq, int* jlo,
                                             int* jhi) {
  const int G = static_cast<int>(a.G);
  for (int i = 0; i < nq; ++i) {
    const int64_t p = p_first + i;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    const int lo_j = static_cast<int>(std::min<int64_t>(std::max<int64_t>(lo - t0, 0), n));
    const int hi_j = static_cast<int>(std::min<int64_t>(p - t0 + 1, n));
    for (int g = 0; g < G; ++g) {
      jlo[i * G + g] = lo_j;
      jhi[i * G + g] = std::max(lo_j, hi_j);
    }
  }
}

// The keys any of rows [rb, rb + rows) sees: [ulo, uhi), empty when ulo >= uhi.
inline void union_of(const int* jlo, const int* jhi, int rb, int rows, int& ulo, int& uhi) {
  ulo = kTileK;
  uhi = 0;
  for (int r = rb; r < rb + rows; ++r)
    if (jlo[r] < jhi[r]) {
      ulo = std::min(ulo, jlo[r]);
      uhi = std::max(uhi, jhi[r]);
    }
}

// Row r's online-softmax step over the 16-key blocks [c0, c1) (at most kTileK / 16) of its raw scores sr, of which
// it sees [lo, hi): the scores times `scale`, the new max m and sum l, acc rescaled, and P = exp(s - m) in bf16
// into pr (zero outside [lo, hi); all zero when the row sees none of them). One pass, the scores in registers:
// as separate loops (max, exp and sum, rescale, round) with a libm exp per row it was most of a prefill's
// attention on AMX.
MINISGL_TARGET_BF16 inline void softmax_p_row(const float* sr, int lo, int hi, int c0, int c1, float scale, float& m,
                                              float& l, float* acc, int Dp, uint16_t* pr) {
  constexpr int kBlocks = kTileK / 16;
  __m512 v[kBlocks];
  __mmask16 mk[kBlocks];
  __m512 mx = _mm512_set1_ps(kNegInf);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int c = c0; c < c1; ++c) {
    mk[c - c0] = range16(lo - 16 * c, hi - 16 * c);
    v[c - c0] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[c - c0], sr + 16 * c), sc);
    mx = _mm512_mask_max_ps(mx, mk[c - c0], mx, v[c - c0]);
  }
  if (lo >= hi) {
    for (int c = c0; c < c1; ++c) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * c), _mm256_setzero_si256());
    return;
  }
  const float mnew = std::max(m, _mm512_reduce_max_ps(mx));
  const __m512 mv = _mm512_set1_ps(mnew);
  __m512 sum = _mm512_setzero_ps();
  for (int c = c0; c < c1; ++c) {
    const __m512 p = _mm512_maskz_mov_ps(mk[c - c0], exp_neg16(_mm512_sub_ps(v[c - c0], mv)));
    sum = _mm512_add_ps(sum, p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * c), (__m256i)_mm512_cvtneps_pbh(p));
  }
  const float alpha = m == kNegInf ? 0.f : _mm512_cvtss_f32(exp_neg16(_mm512_set1_ps(m - mnew)));
  l = l * alpha + _mm512_reduce_add_ps(sum);
  if (alpha != 1.f) {
    const __m512 av = _mm512_set1_ps(alpha);
    for (int d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), av));
  }
  m = mnew;
}

// The task's output rows: acc / l, in bf16.
MINISGL_TARGET_BF16 inline void finish_rows(const Args& a, const float* acc, const float* l, int Dp, int64_t q_begin,
                                            int64_t i0, int nq, int64_t h) {
  const int D = static_cast<int>(a.D), G = static_cast<int>(a.G);
  c10::BFloat16* out = static_cast<c10::BFloat16*>(a.out);
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g;
      from_f32(acc + r * Dp, out + ((q_begin + i0 + i) * a.Hq + h * G + g) * D, D, 1.f / l[r]);
    }
}

// One (request, kv head, query block) task, as extend_task in attention.cpp (same visibility rule, same tiles).
MINISGL_TARGET_BF16 void extend_task(const Args& a, int64_t q_begin, int64_t row, int64_t L, int64_t ext, int64_t h,
                                     int64_t i0, int64_t i1, Scratch& sc) {
  constexpr int R = 4;
  const int D = static_cast<int>(a.D), D2 = D / 2, Dp = (D + 63) / 64 * 64;
  const int G = static_cast<int>(a.G), nq = static_cast<int>(i1 - i0), M = nq * G;
  float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data(), *S = sc.s.data();
  // scratch for this body only, sized once per Scratch (every task of a call has the same M <= 64 / G * G, D)
  const size_t h_size = sc.q.size() + sc.s.size() + Dp, w_size = kTileK * D2 + kTileK / 2 * Dp;
  if (sc.h.size() != h_size) sc.h.assign(h_size, 0);   // zeros: the last Dp stay the zero row
  if (sc.w.size() != w_size) sc.w.assign(w_size, 0);
  uint16_t* qb = sc.h.data();            // [M][D]
  uint16_t* pb = qb + M * D;             // [M][kTileK]
  uint32_t* kp = sc.w.data();            // [kTileK / 16][D2][16]
  uint32_t* vp = kp + kTileK * D2;       // [kTileK / 2][Dp]
  int *jlo = sc.jlo.data(), *jhi = sc.jhi.data();
  start_rows(a, q_begin, i0, nq, h, Dp, qb, acc, m, l);
  const int64_t p_first = L - ext + i0, p_last = L - ext + i1 - 1;
  const int64_t k_lo = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  const int64_t k_hi = p_last + 1;
  const uint16_t* kc = static_cast<const uint16_t*>(a.k) + h * a.k_s1;
  const uint16_t* vc = static_cast<const uint16_t*>(a.v) + h * a.v_s1;
  const uint16_t* zero = sc.h.data() + sc.h.size() - Dp;  // a row of zeros (padding keys)
  const __mmask32 last = tail_mask(D % 32 == 0 ? 32 : D % 32);
  for (int64_t t0 = k_lo; t0 < k_hi; t0 += kTileK) {
    const int n = static_cast<int>(std::min<int64_t>(kTileK, k_hi - t0));
    const int n16 = (n + 15) / 16 * 16;
    const uint16_t* rows[kTileK];
    for (int j = 0; j < n; ++j) rows[j] = kc + slot_at(a, row, t0 + j) * a.k_s0;
    for (int j = 0; j < n16; ++j) {  // K as dim pairs of 16 keys; padding keys are zero
      uint32_t* dst = kp + (j / 16) * D2 * 16 + j % 16;
      if (j < n)
        for (int p = 0; p < D2; ++p) std::memcpy(dst + p * 16, rows[j] + 2 * p, 4);
      else
        for (int p = 0; p < D2; ++p) dst[p * 16] = 0;
    }
    for (int j = 0; j < n; ++j) rows[j] = vc + slot_at(a, row, t0 + j) * a.v_s0;
    for (int j = n; j < n16; ++j) rows[j] = zero;
    for (int k = 0; k < n16 / 2; ++k)  // V as key pairs of each dim
      for (int d0 = 0; d0 < D; d0 += 32) {
        const __mmask32 mk = d0 + 32 <= D ? ~__mmask32(0) : last;
        __m512i lo, hi;
        interleave(_mm512_maskz_loadu_epi16(mk, rows[2 * k] + d0), _mm512_maskz_loadu_epi16(mk, rows[2 * k + 1] + d0),
                   lo, hi);
        _mm512_storeu_si512(vp + k * Dp + d0, lo);
        _mm512_storeu_si512(vp + k * Dp + d0 + 16, hi);
      }
    for (int k = 0; k < n16 / 2 && D % 64 != 0; ++k)  // the dims [ceil32(D), Dp) weigh nothing
      for (int d = (D + 31) / 32 * 32; d < Dp; ++d) vp[k * Dp + d] = 0;
    visible_keys(a, p_first, t0, n, nq, jlo, jhi);
    for (int rb = 0; rb < M; rb += R) {
      const int rows_b = std::min(R, M - rb);
      int ulo, uhi;
      union_of(jlo, jhi, rb, rows_b, ulo, uhi);
      if (ulo >= uhi) continue;  // no row of this block sees this tile
      const int c0 = ulo / 16, c1 = (uhi + 15) / 16;
      const uint16_t* qr = qb + rb * D;
      float* Sb = S + rb * kTileK;
      switch (rows_b) {
        case 1: qk_rows<1>(qr, D, kp, c0, c1, a.scale, Sb); break;
        case 2: qk_rows<2>(qr, D, kp, c0, c1, a.scale, Sb); break;
        case 3: qk_rows<3>(qr, D, kp, c0, c1, a.scale, Sb); break;
        default: qk_rows<4>(qr, D, kp, c0, c1, a.scale, Sb); break;
      }
      for (int r = rb; r < rb + rows_b; ++r) {
        softmax_p_row(S + r * kTileK, jlo[r], jhi[r], c0, c1, 1.f, m[r], l[r], acc + r * Dp, Dp, pb + r * kTileK);
      }
      for (int d0 = 0; d0 < Dp; d0 += 64) {
        const uint16_t* P = pb + rb * kTileK;
        float* ar = acc + rb * Dp;
        switch (rows_b) {
          case 1: pv_block<1>(P, vp, Dp, 8 * c0, 8 * c1, d0, ar); break;
          case 2: pv_block<2>(P, vp, Dp, 8 * c0, 8 * c1, d0, ar); break;
          case 3: pv_block<3>(P, vp, Dp, 8 * c0, 8 * c1, d0, ar); break;
          default: pv_block<4>(P, vp, Dp, 8 * c0, 8 * c1, d0, ar); break;
        }
      }
    }
  }
  finish_rows(a, acc, l, Dp, q_begin, i0, nq, h);
}

}  // namespace bf16
