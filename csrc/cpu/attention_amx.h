// attention_amx.h -- the bf16 decode and extend bodies of attention.cpp on AMX tiles (included there, inside its anonymous
// namespace, after attention_bf16.h: Args, slot_at, bf16::interleave come from there).
//
// A decode task is G query heads (one GQA group) against the keys [k0, k1) of one request. The fp32 body widens
// every K and V element and spends most of its time on that and on the multiply-adds: on a 2-core Intel Xeon it
// ran a 48-request step's attention at twice the time its bytes take to read. Here both products run on AMX, in
// two passes over the task's keys, so that the sums can stay in the tiles (no online rescaling):
//   1. S^T = K Q^T, 16 keys at a time: a tile of 16 K rows (loaded straight from the cache when the 16 slots are
//      consecutive, as a page's are; else gathered) times Q^T in pairs layout ([d pair][head] words, zero past
//      the G heads); their maximum per head is kept, and the 16 x 16 tile of scores is transposed in registers
//      into a per-thread buffer [head][key], so that pass 2 reads each head's scores as whole vectors;
//   2. P = exp(scale (S - max)) for each head (fp32; its sum is the softmax denominator), rounded to bf16 as
//      flash attention does, then O += P V, 32 keys at a time: V's rows interleaved into key pairs ([key pair]
//      [dim] words, four tiles of 16 dims) and P as a tile [head][32 keys]; O stays in four tiles.
// The task leaves the same partial state as the fp32 body (max, sum, weighted V of each head), so splitting long
// requests and merging their parts are unchanged. head_dim 64 and G <= 16 only (the tiles hold 16 heads and four
// blocks of 16 dims); other shapes keep the fp32 body.
#pragma once

#define MINISGL_TARGET_AMX \
  __attribute__((target(MINISGL_AMX_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"), flatten))

namespace amx_attn {

constexpr int kD = 64;

inline bool runs(int64_t D, int64_t G) { return D == kD && G >= 1 && G <= 16 && amx_available(); }

// Rows of 64 bf16 (one K or V head of a key): copy, or zeros where there is no key.
MINISGL_TARGET_AMX inline void load_row(const uint16_t* src, __m512i& lo, __m512i& hi) {
  if (src) {
    lo = _mm512_loadu_si512(src);
    hi = _mm512_loadu_si512(src + 32);
  } else {
    lo = hi = _mm512_setzero_si512();
  }
}

// Asks for the K or V rows (128 bytes each) of keys [from, to) of the task: pages are scattered, so the hardware
// prefetchers cannot run ahead of a request's rows.
MINISGL_TARGET_AMX inline void prefetch_rows(const Args& a, int64_t row, int64_t k0, const uint16_t* cache, int64_t s0,
                                             int64_t from, int64_t to) {
  for (int64_t j = from; j < to; ++j) {
    const char* r = reinterpret_cast<const char*>(cache + slot_at(a, row, k0 + j) * s0);
    _mm_prefetch(r, _MM_HINT_T2);
    _mm_prefetch(r + 64, _MM_HINT_T2);
  }
}

// r[i] word j -> r[j] word i: a 16 x 16 transpose of 32-bit words, in four rounds of shuffles.
MINISGL_TARGET_AMX inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

constexpr int64_t kAhead = 64;  // keys prefetched ahead of the one being read

MINISGL_TARGET_AMX void decode_task(const Args& a, int64_t b, int64_t row, int64_t h, int64_t k0, int64_t k1,
                                    float* part) {
  const int G = static_cast<int>(a.G);
  const int64_t n = k1 - k0, n32 = (n + 31) / 32 * 32;
  const uint16_t* kc = static_cast<const uint16_t*>(a.k) + h * a.k_s1;
  const uint16_t* vc = static_cast<const uint16_t*>(a.v) + h * a.v_s1;
  const uint16_t* qb = static_cast<const uint16_t*>(a.q) + b * a.q_s0 + h * G * a.q_s1;
  alignas(64) static thread_local uint32_t qt[2][16][16];  // Q^T per k step of 32 dims: [d pair][head]
  alignas(64) static thread_local uint16_t kbuf[16][kD];   // gathered K rows
  alignas(64) static thread_local uint32_t vt[4][16][16];  // V per block of 16 dims: [key pair][dim]
  alignas(64) static thread_local uint16_t pbuf[16][32];   // P: [head][key]
  alignas(64) static thread_local float ob[4][16][16];     // O per block of 16 dims: [head][dim]
  static thread_local std::vector<float> sh;                // S: [head][key], transposed from the tiles' S^T
  if (static_cast<int64_t>(sh.size()) < G * n32) sh.resize(G * n32);
  std::memset(qt, 0, sizeof qt);
  for (int g = 0; g < G; ++g) {
    uint32_t qr[kD / 2];
    std::memcpy(qr, qb + g * a.q_s1, sizeof qr);
    for (int s = 0; s < 2; ++s)
      for (int dp = 0; dp < 16; ++dp) qt[s][dp][g] = qr[16 * s + dp];
  }
  amx_tiles_16x64();
  _tile_loadd(4, qt[0], 64);
  _tile_loadd(5, qt[1], 64);

  // Pass 1: S^T = K Q^T, 16 keys per tile.
  __m512 mx = _mm512_set1_ps(kNegInf);
  for (int64_t t0 = 0; t0 < n32; t0 += 16) {
    const int cnt = static_cast<int>(std::min<int64_t>(16, n - t0));
    if (cnt <= 0) {  // the second half of the last 32: no keys
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(sh.data() + g * n32 + t0, _mm512_set1_ps(kNegInf));
      continue;
    }
    const int64_t s0 = slot_at(a, row, k0 + t0);
    bool consecutive = cnt == 16;
    for (int j = 1; j < cnt && consecutive; ++j) consecutive = slot_at(a, row, k0 + t0 + j) == s0 + j;
    const uint16_t* base = kc + s0 * a.k_s0;
    int64_t stride = a.k_s0 * 2;
    if (!consecutive) {
      for (int j = 0; j < 16; ++j) {
        if (j < cnt) std::memcpy(kbuf[j], kc + slot_at(a, row, k0 + t0 + j) * a.k_s0, kD * 2);
        else std::memset(kbuf[j], 0, kD * 2);
      }
      base = kbuf[0];
      stride = kD * 2;
    }
    if (t0 == 0) prefetch_rows(a, row, k0, kc, a.k_s0, 16, std::min(n, kAhead));
    prefetch_rows(a, row, k0, kc, a.k_s0, std::min(n, t0 + kAhead), std::min(n, t0 + kAhead + 16));
    if (t0 + 16 >= n) prefetch_rows(a, row, k0, vc, a.v_s0, 0, std::min(n, kAhead));  // pass 2's first rows
    _tile_zero(0);
    _tile_loadd(2, base, stride);
    _tile_loadd(3, base + 32, stride);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(0, 3, 5);
    alignas(64) float st[16][16];  // S^T of these keys: [key][head]
    _tile_stored(0, st, 64);
    __m512i r[16];
    for (int j = 0; j < 16; ++j) {
      const __m512 v = j < cnt ? _mm512_load_ps(st[j]) : _mm512_set1_ps(kNegInf);  // no key: no weight
      mx = _mm512_max_ps(mx, v);
      r[j] = _mm512_castps_si512(v);
    }
    transpose16(r);  // each head's scores as one vector, so that pass 2 reads them whole, not one by one
    for (int g = 0; g < G; ++g) _mm512_storeu_si512(sh.data() + g * n32 + t0, r[g]);
  }
  alignas(64) float mh[16];
  _mm512_store_ps(mh, _mm512_mul_ps(mx, _mm512_set1_ps(a.scale)));  // the scaled maximum per head

  // Pass 2: P = exp(scale S - max), O += P V, 32 keys per step.
  __m512 lsum[16];
  for (int g = 0; g < G; ++g) lsum[g] = _mm512_setzero_ps();
  std::memset(pbuf, 0, sizeof pbuf);
  const __m512 scale = _mm512_set1_ps(a.scale);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t0 = 0; t0 < n32; t0 += 32) {
    for (int g = 0; g < G; ++g) {
      const float* sg = sh.data() + g * n32 + t0;
      const __m512 m = _mm512_set1_ps(mh[g]);
      const __m512 e0 = exp_neg16(_mm512_fmsub_ps(_mm512_loadu_ps(sg), scale, m));
      const __m512 e1 = exp_neg16(_mm512_fmsub_ps(_mm512_loadu_ps(sg + 16), scale, m));
      lsum[g] = _mm512_add_ps(lsum[g], _mm512_add_ps(e0, e1));
      _mm512_store_si512(pbuf[g], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    for (int tp = 0; tp < 16; ++tp) {
      const int64_t k = t0 + 2 * tp;
      const uint16_t* r0 = k < n ? vc + slot_at(a, row, k0 + k) * a.v_s0 : nullptr;
      const uint16_t* r1 = k + 1 < n ? vc + slot_at(a, row, k0 + k + 1) * a.v_s0 : nullptr;
      __m512i a0, a1, b0, b1, lo, hi;
      load_row(r0, a0, a1);
      load_row(r1, b0, b1);
      bf16::interleave(a0, b0, lo, hi);
      _mm512_store_si512(vt[0][tp], lo);
      _mm512_store_si512(vt[1][tp], hi);
      bf16::interleave(a1, b1, lo, hi);
      _mm512_store_si512(vt[2][tp], lo);
      _mm512_store_si512(vt[3][tp], hi);
    }
    prefetch_rows(a, row, k0, vc, a.v_s0, std::min(n, t0 + kAhead), std::min(n, t0 + kAhead + 32));
    _tile_loadd(4, pbuf, 64);
    _tile_loadd(5, vt[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, vt[1], 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, vt[2], 64);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, vt[3], 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, ob[0], 64);
  _tile_stored(1, ob[1], 64);
  _tile_stored(2, ob[2], 64);
  _tile_stored(3, ob[3], 64);
  float* m = part;
  float* l = part + G;
  float* acc = part + 2 * G;
  for (int g = 0; g < G; ++g) {
    m[g] = mh[g];
    l[g] = _mm512_reduce_add_ps(lsum[g]);
    for (int d = 0; d < 4; ++d) std::memcpy(acc + g * kD + 16 * d, ob[d][g], 16 * sizeof(float));
  }
}

// Extend (prefill) on AMX: the task and the gathered tiles of bf16::extend_task (K as dim pairs of 16 keys, V as key
// pairs of each dim: both are AMX's B layout already), with the two products on tiles, 16 (query, head) rows at a
// time: S = Q K^T two key blocks per pass (tmm0, tmm1 from Q in tmm4 and K in tmm6, tmm7), and acc += P V two
// blocks of 16 dims at a time, the fp32 acc loaded into tmm0, tmm1 and stored back (the online softmax rescales it
// in memory, as the vector body does). head_dim a multiple of 32.
inline bool extend_runs(int64_t D) { return D % 32 == 0 && D <= 256 && amx_available(); }

MINISGL_TARGET_AMX void extend_task(const Args& a, int64_t q_begin, int64_t row, int64_t L, int64_t ext, int64_t h,
                                    int64_t i0, int64_t i1, Scratch& sc) {
  constexpr int kRows = 16;
  const int D = static_cast<int>(a.D), D2 = D / 2, Dp = D;  // D % 32 == 0
  const int G = static_cast<int>(a.G), nq = static_cast<int>(i1 - i0), M = nq * G;
  float *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data(), *S = sc.s.data();
  const size_t h_size = sc.q.size() + sc.s.size() + Dp, w_size = kTileK * D2 + kTileK / 2 * Dp;
  if (sc.h.size() != h_size) sc.h.assign(h_size, 0);
  if (sc.w.size() != w_size) sc.w.assign(w_size, 0);
  uint16_t* qb = sc.h.data();            // [M][D]
  uint16_t* pb = qb + M * D;             // [M][kTileK]
  uint32_t* kp = sc.w.data();            // [kTileK / 16][D2][16]
  uint32_t* vp = kp + kTileK * D2;       // [kTileK / 2][Dp]
  int *jlo = sc.jlo.data(), *jhi = sc.jhi.data();
  bf16::start_rows(a, q_begin, i0, nq, h, Dp, qb, acc, m, l);
  const int64_t p_first = L - ext + i0, p_last = L - ext + i1 - 1;
  const int64_t k_lo = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  const int64_t k_hi = p_last + 1;
  const uint16_t* kc = static_cast<const uint16_t*>(a.k) + h * a.k_s1;
  const uint16_t* vc = static_cast<const uint16_t*>(a.v) + h * a.v_s1;
  const int steps = D / 32;
  for (int64_t t0 = k_lo; t0 < k_hi; t0 += kTileK) {
    const int n = static_cast<int>(std::min<int64_t>(kTileK, k_hi - t0));
    const int n32 = (n + 31) / 32 * 32;  // PV takes keys 32 at a time: the padding keys are zero
    const uint16_t* rows[kTileK];
    for (int j = 0; j < n; ++j) rows[j] = kc + slot_at(a, row, t0 + j) * a.k_s0;
    for (int j0 = 0; j0 < n32; j0 += 16)  // K as dim pairs of 16 keys: 16 x 16 word transposes; padding keys are zero
      for (int p0 = 0; p0 < D2; p0 += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = j0 + j < n ? _mm512_loadu_si512(rows[j0 + j] + 2 * p0) : _mm512_setzero_si512();
        transpose16(r);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kp + ((j0 / 16) * D2 + p0 + p) * 16, r[p]);
      }
    for (int j = 0; j < n; ++j) rows[j] = vc + slot_at(a, row, t0 + j) * a.v_s0;  // each V row looked up once
    for (int k = 0; k < n32 / 2; ++k)  // V as key pairs of each dim
      for (int d0 = 0; d0 < D; d0 += 32) {
        const int j0 = 2 * k, j1 = 2 * k + 1;
        const __m512i r0 = j0 < n ? _mm512_loadu_si512(rows[j0] + d0) : _mm512_setzero_si512();
        const __m512i r1 = j1 < n ? _mm512_loadu_si512(rows[j1] + d0) : _mm512_setzero_si512();
        __m512i lo, hi;
        bf16::interleave(r0, r1, lo, hi);
        _mm512_storeu_si512(vp + k * Dp + d0, lo);
        _mm512_storeu_si512(vp + k * Dp + d0 + 16, hi);
      }
    bf16::visible_keys(a, p_first, t0, n, nq, jlo, jhi);
    for (int rb = 0; rb < M; rb += kRows) {
      const int rows_b = std::min(kRows, M - rb);
      int ulo, uhi;
      bf16::union_of(jlo, jhi, rb, rows_b, ulo, uhi);
      if (ulo >= uhi) continue;  // no row of this block sees this tile
      const int c0 = ulo / 32 * 2, c1 = (uhi + 31) / 32 * 2;  // 16-key blocks, in pairs (PV takes 32 keys)
      amx_tiles_rows(rows_b, 0);
      const uint16_t* qr = qb + rb * D;
      float* Sb = S + rb * kTileK;
      for (int c = c0; c < c1; c += 2) {  // S = Q K^T, 32 keys per pass
        _tile_zero(0);
        _tile_zero(1);
        for (int s = 0; s < steps; ++s) {
          _tile_loadd(4, qr + 32 * s, 2 * D);
          _tile_loadd(6, kp + (c * D2 + 16 * s) * 16, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, kp + ((c + 1) * D2 + 16 * s) * 16, 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, Sb + 16 * c, kTileK * 4);
        _tile_stored(1, Sb + 16 * (c + 1), kTileK * 4);
      }
      for (int r = rb; r < rb + rows_b; ++r)
        bf16::softmax_p_row(S + r * kTileK, jlo[r], jhi[r], c0, c1, a.scale, m[r], l[r], acc + r * Dp, Dp,
                            pb + r * kTileK);
      const uint16_t* P = pb + rb * kTileK;
      float* ar = acc + rb * Dp;
      for (int d0 = 0; d0 < D; d0 += 32) {  // acc += P V, two blocks of 16 dims per pass
        _tile_loadd(0, ar + d0, Dp * 4);
        _tile_loadd(1, ar + d0 + 16, Dp * 4);
        for (int c = c0; c < c1; c += 2) {
          _tile_loadd(4, P + 16 * c, kTileK * 2);
          _tile_loadd(6, vp + (8 * c) * Dp + d0, Dp * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, vp + (8 * c) * Dp + d0 + 16, Dp * 4);
          _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, ar + d0, Dp * 4);
        _tile_stored(1, ar + d0 + 16, Dp * 4);
      }
    }
  }
  bf16::finish_rows(a, acc, l, Dp, q_begin, i0, nq, h);
}

}  // namespace amx_attn
