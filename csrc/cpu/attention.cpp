// attention.cpp -- paged decode and extend (prefill) attention on the CPU.
//
// Layouts (see common.h): q [N, Hq, D] (last dim contiguous), k_cache/v_cache [num_slots, Hkv, D] (last dim
// contiguous), page_table [rows, max_seq_len] int32|int64 with page_table[row, pos] = slot, table_idx /
// seq_lens / extend_lens [B]. Output [N, Hq, D] contiguous in q's dtype. fp32 accumulation throughout.
//
// Work split. GQA groups the G = Hq / Hkv query heads that share a KV head, and a task always owns a whole
// group, so each K/V row is loaded (and converted to fp32) once for G heads.
//   decode : task = (request, kv head, key chunk of kSplitKeys or more); a long request's chunks leave partial
//            softmax states (max, sum, weighted V) that are merged afterwards. A request's
//            heads are taken by one thread in turn (`task_group`): they read the same slots. Per tile of
//            kDecodeTile keys: W scores at a time from `dots` (one transposing reduction tree instead of W
//            horizontal sums), then acc += P V over row pointers (`gemm_rows`); the next tile's rows are
//            prefetched, since page boundaries defeat the hardware prefetcher. The AVX2 body reads K and V
//            rows from their pages, widened in registers once for every three heads (see decode_task).
//   extend : task = (request, kv head, block of queries); the block walks its visible keys in tiles of
//            kTileK, gathering a K tile transposed ([D][kTileK]) and a V tile row-major, so that
//            S = Q K^T and acc += P V are register-blocked products (`gemm` in vec.h).
// Tasks are sorted by estimated cost and handed out dynamically (an atomic counter), so a few long
// requests do not leave a thread idle at the end.
//
// ISA: the task bodies are templates instantiated inside wrappers compiled for AVX-512, AVX2 and the
// baseline (GCC/Clang `target` + `flatten`), and the best one is chosen once at run time, so the wheel
// stays portable while the hot loops use the widest vectors the machine has. bf16 caches on a CPU with
// AVX512-BF16 take the extend body of attention_bf16.h instead (bf16 dot products, no widening of K/V), and on a
// CPU with AMX the decode and extend bodies of attention_amx.h (both products on tiles).
//
// Trust: table rows, lengths and extend lengths are checked here; the slots stored in the page table are
// not (that would cost a pass over every position) -- they come from the scheduler's allocator.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>  // the AVX512-BF16 bodies (attention_bf16.h, included below inside the namespace)
#endif

#include "../common.h"
#include "../ops.h"
#include "amx.h"
#include "attention_plan.h"
#include "isa.h"
#include "vec.h"

namespace minisgl {
namespace cpu {
namespace {

constexpr int kTileK = 64;     // keys per tile
constexpr int kDecodeTile = 32;  // keys per decode tile
// Keys per decode task, at least: a request's softmax states over its chunks are merged. 512 left a lone request of
// 512-1023 keys with one task per KV head: 3 tasks for 2 threads with SmolLM2's 3 heads; at 256 a one-request step
// of the embedded model (2 threads, AVX2 Zen 3, 40 interleaved rounds twice) took 5-6% less at 600 keys, 4-5% at
// 900, the same at 300 and 1200, 0-2% less at 2000.
constexpr int64_t kSplitKeys = 256;
constexpr int64_t kMaxScratchD = 1024;

struct Args {
  const void* q;
  int64_t q_s0, q_s1;
  const void* k;
  const void* v;
  int64_t k_s0, k_s1, v_s0, v_s1;
  const void* pt;
  bool pt64;
  int64_t pt_s0, pt_s1;
  int64_t Hq, Hkv, G, D, window;
  float scale;
  void* out;  // contiguous [N, Hq, D]
};

inline int64_t slot_at(const Args& a, int64_t row, int64_t pos) {
  const int64_t off = row * a.pt_s0 + pos * a.pt_s1;
  return a.pt64 ? static_cast<const int64_t*>(a.pt)[off] : static_cast<const int32_t*>(a.pt)[off];
}

// Per-thread scratch, sized for the largest task.
struct Scratch {
  std::vector<float> q, acc, m, l, kt, vt, s, row, zero;  // zero: a row of D zeros (padding keys)
  std::vector<int> jlo, jhi;
  std::vector<uint16_t> h;  // the bf16 extend body's queries, P and a zero row (sized there, on first use)
  std::vector<uint32_t> w;  // the bf16 extend body's K and V tiles in pairs layout (likewise)
  Scratch(int64_t M, int64_t D, int64_t G)
      : q(M * D), acc(M * pad(D)), m(M), l(M), kt(D * kTileK), vt(kTileK * pad(D)),
        s(std::max<int64_t>(G * kDecodeTile, M * kTileK)), row(D), zero(D, 0.f), jlo(M), jhi(M) {}
  static int64_t pad(int64_t D) { return (D + 63) / 64 * 64; }
};

// ---------------------------------------------------------------- decode
// Cfg gives the vector width W and the R x C register block of an ISA variant.
struct CfgAvx512 { static constexpr int W = 16, R = 4, C = 4; };
struct CfgAvx2 { static constexpr int W = 8, R = 4, C = 2; };
struct CfgBase { static constexpr int W = 4, R = 4, C = 2; };

// One (request, kv head, key range) task: the partial softmax state of G query heads over keys [k0, k1),
// written to part = [m[G], l[G], acc[G][D]]. With a specialised head_dim, scores come W at a time from
// `dots` and acc += P V is a register-blocked product over row pointers; otherwise plain dot/axpy loops.
// The AVX2 body (fp32 or bf16 caches, head_dim 64 or 128; fp16 and other head dims keep the path above) reads each
// K and V row from its page instead, widened in registers once for every three query heads (all of them where
// G <= 3), `dots_4keys_gqa_avx2` and `pv_gqa_avx2`: widening bf16 rows into scratch and reading them back once per
// head (`dots`) or per four heads (`gemm_rows`) was most of its time. On the Zen 3 (AVX2, 2 threads, bf16 caches,
// SmolLM2's 9 / 3 heads), a layer's call over 30 layers' caches (from memory, as in a real step): one request of
// 2,000 keys 291 -> 252 us, of 600 keys 122 -> 106, sixteen requests of 300 480 -> 420; one thread, one request of
// 4,000 keys in its caches: 148 -> 103 and 100 -> 71 cycles a (key, KV head) in two runs; the whole decode of one
// request after 2,000 tokens +10% (12 of 12 pairs, the two paths switched in turn in one process by a throwaway
// build), after 500 +4%. Its
// prefetches of the next tile are spread over the K pass, four rows at a time: issued all at once, they made the
// whole decode 9% slower than the scratch path (in the kernel's own benchmark the caches fit the L2 and it did not
// show).
template <typename T, int kD, typename Cfg>
inline void decode_task(const Args& a, int64_t b, int64_t row, int64_t h, int64_t k0, int64_t k1, float* part,
                        Scratch& sc) {
  constexpr int W = Cfg::W;
  constexpr bool kBlocked = kD > 0 && kD % (Cfg::C * W) == 0 && kDecodeTile % W == 0;
  // K and V rows read from their pages, widened in registers (see above)
  constexpr bool kRowsFromPages = kMinisglX86 && W == 8 && kD > 0 && kD % 16 == 0 &&
                            (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>);
  const int D = kD > 0 ? kD : static_cast<int>(a.D);
  const int G = static_cast<int>(a.G);
  float* qf = sc.q.data();
  float* m = part;
  float* l = part + G;
  float* acc = part + 2 * G;
  float* s = sc.s.data();
  float* kbuf = sc.kt.data();  // [kDecodeTile][D]
  const float* zero = sc.zero.data();
  const T* qb = static_cast<const T*>(a.q) + b * a.q_s0 + h * G * a.q_s1;
  for (int g = 0; g < G; ++g) {
    to_f32(qb + g * a.q_s1, qf + g * D, D);
    scale_row<kD>(qf + g * D, a.scale, D);
    m[g] = kNegInf;
    l[g] = 0.f;
  }
  std::fill(acc, acc + G * D, 0.f);
  const T* kc = static_cast<const T*>(a.k) + h * a.k_s1;
  const T* vc = static_cast<const T*>(a.v) + h * a.v_s1;
  int64_t slots[kDecodeTile];
  const float* rows[kDecodeTile];
  for (int64_t t0 = k0; t0 < k1; t0 += kDecodeTile) {
    const int n = static_cast<int>(std::min<int64_t>(kDecodeTile, k1 - t0));
    for (int j = 0; j < n; ++j) slots[j] = slot_at(a, row, t0 + j);
    // The rows of a request are scattered over pages, which defeats the hardware prefetcher at every
    // page boundary: ask for the next tile's K/V rows while this one is computed, one next row per row
    // converted (asking for all 4 * kDecodeTile lines at once filled the queue of misses and stalled: the
    // attention of a 48-row decode step over 30 layers took 21 ms that way, 17 ms spread out, on a Zen 5;
    // benchmarks/bench_kernels.py --step-only).
    const int64_t ahead = std::min<int64_t>(kDecodeTile, k1 - t0 - kDecodeTile);
    auto prefetch_next = [&](int j) {  // row j of the next tile
      const int64_t next = slot_at(a, row, t0 + kDecodeTile + j);
      prefetch_row(kc + next * a.k_s0, D);
      prefetch_row(vc + next * a.v_s0, D);
    };
    if constexpr (kRowsFromPages) {
      static_assert(kDecodeTile % 4 == 0, "keys are scored four at a time");
      const T* krows[kDecodeTile];
      for (int j = 0; j < n; ++j) krows[j] = kc + slots[j] * a.k_s0;
      const int n_pad = (n + 3) / 4 * 4;
      for (int j = n; j < n_pad; ++j) krows[j] = krows[n - 1];  // their scores are never read
      for (int j0 = 0; j0 < n_pad; j0 += 4) {
        for (int j = j0; j < std::min<int64_t>(j0 + 4, ahead); ++j) prefetch_next(j);  // spread over the K pass (above)
        dots_4keys_gqa_avx2(qf, G, D, krows + j0, s + j0, kDecodeTile);
      }
    } else {
      for (int j = 0; j < n; ++j) {
        if (j < ahead) prefetch_next(j);
        rows[j] = row_f32(kc + slots[j] * a.k_s0, kbuf + j * D, D);
      }
      if constexpr (kBlocked) {
        const int n_pad = (n + W - 1) / W * W;
        for (int j = n; j < n_pad; ++j) rows[j] = zero;
        for (int g = 0; g < G; ++g)
          for (int j0 = 0; j0 < n_pad; j0 += W) dots<W>(qf + g * D, rows + j0, s + g * kDecodeTile + j0, D / W);
      } else {
        for (int j = 0; j < n; ++j)
          for (int g = 0; g < G; ++g) s[g * kDecodeTile + j] = dot<kD>(qf + g * D, rows[j], D);
      }
    }
    for (int g = 0; g < G; ++g) {
      float* sg = s + g * kDecodeTile;
      const float mnew = std::max(m[g], max_of(sg, n));
      const float alpha = std::exp(m[g] - mnew);  // 0 on the first tile (m = -inf)
      l[g] = l[g] * alpha + exp_sum(sg, mnew, n);
      if (alpha != 1.f) scale_row<kD>(acc + g * D, alpha, D);
      m[g] = mnew;
    }
    if constexpr (kRowsFromPages) {
      const T* vrows[kDecodeTile];
      for (int j = 0; j < n; ++j) vrows[j] = vc + slots[j] * a.v_s0;
      pv_gqa_avx2(s, kDecodeTile, G, vrows, n, acc, D);
    } else {
      for (int j = 0; j < n; ++j) rows[j] = row_f32(vc + slots[j] * a.v_s0, kbuf + j * D, D);
      if constexpr (kBlocked) {
        gemm_rows<W, Cfg::R, Cfg::C>(G, s, kDecodeTile, rows, n, acc, D, D);
      } else {
        for (int j = 0; j < n; ++j)
          for (int g = 0; g < G; ++g) axpy<kD>(acc + g * D, s[g * kDecodeTile + j], rows[j], D);
      }
    }
  }
}

// ---------------------------------------------------------------- extend
// One (request, kv head, query block) task. Query i of the request (0 <= i < ext) sits at position
// L - ext + i and sees keys [lo(p), p], lo(p) = max(0, p - window + 1) with a window, else 0.
// Per key tile: S = Q K^T (register-blocked), online-softmax update of each row, acc += P V.
// Cfg gives the vector width W and the R x C register block of the ISA variant.
constexpr int kPadD = 64;  // acc / V rows are padded to a multiple of the widest C * W

template <typename T, int kD, typename Cfg>
inline void extend_task(const Args& a, int64_t q_begin, int64_t row, int64_t L, int64_t ext, int64_t h,
                        int64_t i0, int64_t i1, Scratch& sc) {
  constexpr int W = Cfg::W, R = Cfg::R, C = Cfg::C;
  const int D = kD > 0 ? kD : static_cast<int>(a.D);
  const int Dp = (D + kPadD - 1) / kPadD * kPadD;
  const int G = static_cast<int>(a.G), nq = static_cast<int>(i1 - i0), M = nq * G;
  float *qf = sc.q.data(), *acc = sc.acc.data(), *m = sc.m.data(), *l = sc.l.data();
  float *kt = sc.kt.data(), *vt = sc.vt.data(), *S = sc.s.data(), *tmp = sc.row.data();
  int* jlo = sc.jlo.data();
  int* jhi = sc.jhi.data();
  for (int i = 0; i < nq; ++i) {
    const T* qi = static_cast<const T*>(a.q) + (q_begin + i0 + i) * a.q_s0 + h * G * a.q_s1;
    for (int g = 0; g < G; ++g) {
      float* qr = qf + (i * G + g) * D;
      to_f32(qi + g * a.q_s1, qr, D);
      scale_row<kD>(qr, a.scale, D);
    }
  }
  std::fill(acc, acc + M * Dp, 0.f);
  std::fill(vt, vt + kTileK * Dp, 0.f);
  std::fill(m, m + M, kNegInf);
  std::fill(l, l + M, 0.f);
  const int64_t p_first = L - ext + i0, p_last = L - ext + i1 - 1;
  const int64_t k_lo = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  const int64_t k_hi = p_last + 1;
  const T* kc = static_cast<const T*>(a.k) + h * a.k_s1;
  const T* vc = static_cast<const T*>(a.v) + h * a.v_s1;
  for (int64_t t0 = k_lo; t0 < k_hi; t0 += kTileK) {
    const int n = static_cast<int>(std::min<int64_t>(kTileK, k_hi - t0));
    // gather the tile: K transposed ([D][kTileK], zero-padded columns), V row-major ([kTileK][Dp])
    for (int j = 0; j < n; ++j) {
      const int64_t slot = slot_at(a, row, t0 + j);
      const float* kr = row_f32(kc + slot * a.k_s0, tmp, D);
      for (int d = 0; d < D; ++d) kt[d * kTileK + j] = kr[d];
      to_f32(vc + slot * a.v_s0, vt + j * Dp, D);
    }
    for (int d = 0; d < D; ++d)
      for (int j = n; j < kTileK; ++j) kt[d * kTileK + j] = 0.f;
    // the visible columns [jlo, jhi) of each (query, head) row in this tile
    for (int i = 0; i < nq; ++i) {
      const int64_t p = p_first + i;
      const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
      const int lo_j = static_cast<int>(std::max<int64_t>(lo - t0, 0));
      const int hi_j = static_cast<int>(std::min<int64_t>(p - t0 + 1, n));
      for (int g = 0; g < G; ++g) {
        jlo[i * G + g] = lo_j;
        jhi[i * G + g] = std::max(lo_j, hi_j);
      }
    }
    for (int rb = 0; rb < M; rb += R) {
      const int rows = std::min(R, M - rb);
      int ulo = kTileK, uhi = 0;
      for (int r = rb; r < rb + rows; ++r)
        if (jlo[r] < jhi[r]) {
          ulo = std::min(ulo, jlo[r]);
          uhi = std::max(uhi, jhi[r]);
        }
      if (ulo >= uhi) continue;  // no row of this block sees this tile
      gemm<W, R, C>(rows, qf + rb * D, D, kt, kTileK, 0, D, S + rb * kTileK, kTileK, kTileK, false);
      for (int r = rb; r < rb + rows; ++r) {
        float* sr = S + r * kTileK;
        if (jlo[r] < jhi[r]) {
          const float mnew = std::max(m[r], max_of(sr + jlo[r], jhi[r] - jlo[r]));
          const float alpha = std::exp(m[r] - mnew);
          l[r] = l[r] * alpha + exp_sum(sr + jlo[r], mnew, jhi[r] - jlo[r]);
          if (alpha != 1.f) scale_row<0>(acc + r * Dp, alpha, Dp);
          m[r] = mnew;
        }
        for (int j = ulo; j < std::min(jlo[r], uhi); ++j) sr[j] = 0.f;  // masked columns weigh nothing
        for (int j = std::max(jhi[r], ulo); j < uhi; ++j) sr[j] = 0.f;
      }
      gemm<W, R, C>(rows, S + rb * kTileK, kTileK, vt, Dp, ulo, uhi, acc + rb * Dp, Dp, Dp, true);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int i = 0; i < nq; ++i)
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g;
      from_f32(acc + r * Dp, out + ((q_begin + i0 + i) * a.Hq + h * G + g) * D, D, 1.f / l[r]);
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#include "attention_bf16.h"
#include "attention_amx.h"
#endif

// ---------------------------------------------------------------- ISA variants
struct DecodeTask { int64_t b, row, h, k0, k1, part; };
struct ExtendTask { int64_t q_begin, row, L, ext, h, i0, i1; };

template <typename T, int kD, typename Cfg>
inline void run_decode(const Args& a, const DecodeTask& t, float* parts, Scratch& sc) {
  decode_task<T, kD, Cfg>(a, t.b, t.row, t.h, t.k0, t.k1, parts + t.part * a.G * (a.D + 2), sc);
}
template <typename T, int kD, typename Cfg>
inline void run_extend(const Args& a, const ExtendTask& t, Scratch& sc) {
  extend_task<T, kD, Cfg>(a, t.q_begin, t.row, t.L, t.ext, t.h, t.i0, t.i1, sc);
}

// A variant runs a task for one (dtype, head_dim) with the hot loops compiled for one ISA.
template <typename T, typename Cfg>
inline void decode_any(const Args& a, const DecodeTask& t, float* parts, Scratch& sc) {
  switch (a.D) {
    case 64: return run_decode<T, 64, Cfg>(a, t, parts, sc);
    case 128: return run_decode<T, 128, Cfg>(a, t, parts, sc);
    default: return run_decode<T, 0, Cfg>(a, t, parts, sc);
  }
}
template <typename T, typename Cfg>
inline void extend_any(const Args& a, const ExtendTask& t, Scratch& sc) {
  switch (a.D) {
    case 64: return run_extend<T, 64, Cfg>(a, t, sc);
    case 128: return run_extend<T, 128, Cfg>(a, t, sc);
    default: return run_extend<T, 0, Cfg>(a, t, sc);
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define MINISGL_X86 1
#define MINISGL_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"), flatten))
#define MINISGL_TARGET_AVX2 __attribute__((target("avx2,fma,f16c"), flatten))
#endif

#define MINISGL_DEFINE_VARIANTS(T, suffix)                                                                   \
  __attribute__((flatten)) void decode_##suffix##_base(const Args& a, const DecodeTask& t, float* p,         \
                                                       Scratch& sc) { decode_any<T, CfgBase>(a, t, p, sc); }  \
  __attribute__((flatten)) void extend_##suffix##_base(const Args& a, const ExtendTask& t, Scratch& sc) {    \
    extend_any<T, CfgBase>(a, t, sc);                                                                         \
  }                                                                                                           \
  MINISGL_X86_VARIANTS(T, suffix)

#ifdef MINISGL_X86
#define MINISGL_X86_VARIANTS(T, suffix)                                                                      \
  MINISGL_TARGET_AVX512 void decode_##suffix##_avx512(const Args& a, const DecodeTask& t, float* p,          \
                                                      Scratch& sc) { decode_any<T, CfgAvx512>(a, t, p, sc); } \
  MINISGL_TARGET_AVX512 void extend_##suffix##_avx512(const Args& a, const ExtendTask& t, Scratch& sc) {     \
    extend_any<T, CfgAvx512>(a, t, sc);                                                                                  \
  }                                                                                                           \
  MINISGL_TARGET_AVX2 void decode_##suffix##_avx2(const Args& a, const DecodeTask& t, float* p, Scratch& sc) { \
    decode_any<T, CfgAvx2>(a, t, p, sc);                                                                      \
  }                                                                                                           \
  MINISGL_TARGET_AVX2 void extend_##suffix##_avx2(const Args& a, const ExtendTask& t, Scratch& sc) {         \
    extend_any<T, CfgAvx2>(a, t, sc);                                                                                  \
  }
#else
#define MINISGL_X86_VARIANTS(T, suffix)
#endif

MINISGL_DEFINE_VARIANTS(float, f32)
MINISGL_DEFINE_VARIANTS(c10::BFloat16, bf16)
MINISGL_DEFINE_VARIANTS(c10::Half, f16)

#ifdef MINISGL_X86
// bf16 caches on a CPU with AMX: the decode body of attention_amx.h (head_dim 64, up to 16 heads per group).
MINISGL_TARGET_AMX void decode_bf16_amx(const Args& a, const DecodeTask& t, float* parts, Scratch&) {
  amx_attn::decode_task(a, t.b, t.row, t.h, t.k0, t.k1, parts + t.part * a.G * (a.D + 2));
}
// bf16 caches on a CPU with AMX: the extend body of attention_amx.h (head_dim a multiple of 32).
MINISGL_TARGET_AMX void extend_bf16_amx(const Args& a, const ExtendTask& t, Scratch& sc) {
  amx_attn::extend_task(a, t.q_begin, t.row, t.L, t.ext, t.h, t.i0, t.i1, sc);
}
// bf16 caches on a CPU with AVX512-BF16: the extend body of attention_bf16.h (even head_dim only).
MINISGL_TARGET_BF16 void extend_bf16_dot(const Args& a, const ExtendTask& t, Scratch& sc) {
  bf16::extend_task(a, t.q_begin, t.row, t.L, t.ext, t.h, t.i0, t.i1, sc);
}
#endif

using DecodeFn = void (*)(const Args&, const DecodeTask&, float*, Scratch&);
using ExtendFn = void (*)(const Args&, const ExtendTask&, Scratch&);

// ---------------------------------------------------------------- bodies, by name
// Every body that runs here for one case (dtype, head_dim, group), the one the CPU's flags suggest first. Which is
// fastest is measured, not assumed: the engine times them on its model's heads as it starts and keeps the fastest
// that answers right (chapter engine, `choose_attention_bodies`); `use_attention_body` makes that body the one
// every call for the case runs, decode steps included (a case never named runs its first body).
template <typename Fn>
struct Named {
  const char* name;
  Fn fn;
};

template <typename Fn>
void add_isa_variants(std::vector<Named<Fn>>& v, Fn avx512, Fn avx2, Fn base) {
  if (best_isa() >= Isa::avx512) v.push_back({"avx512", avx512});
  if (best_isa() >= Isa::avx2) v.push_back({"avx2", avx2});
  v.push_back({"baseline", base});
}
#ifdef MINISGL_X86
#define MINISGL_ADD_VARIANTS(v, kind, suffix) \
  add_isa_variants(v, kind##_##suffix##_avx512, kind##_##suffix##_avx2, kind##_##suffix##_base)
#else
#define MINISGL_ADD_VARIANTS(v, kind, suffix) v.push_back({"baseline", kind##_##suffix##_base})
#endif

// Whether bf16 attention over head_dim D can run the AVX512-BF16 bodies (bf16 dot products) on this machine.
bool bf16_dot(int64_t D) {
#ifdef MINISGL_X86
  return best_isa() == Isa::avx512bf16 && D % 2 == 0;
#else
  return false;
#endif
}

std::vector<Named<DecodeFn>> decode_bodies(at::ScalarType dt, int64_t D, int64_t G) {
  std::vector<Named<DecodeFn>> v;
  if (dt == at::kFloat) {
    MINISGL_ADD_VARIANTS(v, decode, f32);
  } else if (dt == at::kBFloat16) {
#ifdef MINISGL_X86
    if (amx_attn::runs(D, G)) v.push_back({"amx", decode_bf16_amx});
#endif
    MINISGL_ADD_VARIANTS(v, decode, bf16);   // no bf16-dot decode body: measured no faster (attention_bf16.h)
  } else {
    MINISGL_ADD_VARIANTS(v, decode, f16);
  }
  return v;
}
std::vector<Named<ExtendFn>> extend_bodies(at::ScalarType dt, int64_t D, int64_t G) {
  std::vector<Named<ExtendFn>> v;
  if (dt == at::kFloat) {
    MINISGL_ADD_VARIANTS(v, extend, f32);
  } else if (dt == at::kBFloat16) {
#ifdef MINISGL_X86
    if (amx_attn::extend_runs(D)) v.push_back({"amx", extend_bf16_amx});
    if (bf16_dot(D)) v.push_back({"bf16dot", extend_bf16_dot});
#endif
    MINISGL_ADD_VARIANTS(v, extend, bf16);
  } else {
    MINISGL_ADD_VARIANTS(v, extend, f16);
  }
  return v;
}

// The body each case runs (kind 0 decode, 1 extend): resolved on the case's first call (its first body) or set by
// `use_attention_body`, then kept, so that a call costs one map lookup, not a list of its case's bodies.
using Case = std::tuple<int, int, int64_t, int64_t>;
std::mutex chosen_mutex;
std::map<Case, Named<DecodeFn>> decode_chosen;
std::map<Case, Named<ExtendFn>> extend_chosen;

template <typename Fn>
Named<Fn> chosen_body(std::map<Case, Named<Fn>>& chosen, const Case& c,
                      std::vector<Named<Fn>> (*bodies)(at::ScalarType, int64_t, int64_t)) {
  std::lock_guard<std::mutex> lock(chosen_mutex);
  auto it = chosen.find(c);
  if (it == chosen.end())
    it = chosen.emplace(c, bodies(static_cast<at::ScalarType>(std::get<1>(c)), std::get<2>(c), std::get<3>(c)).front()).first;
  return it->second;
}
DecodeFn pick_decode(at::ScalarType dt, int64_t D, int64_t G) {
  return chosen_body(decode_chosen, Case{0, static_cast<int>(dt), D, G}, decode_bodies).fn;
}
ExtendFn pick_extend(at::ScalarType dt, int64_t D, int64_t G) {
  return chosen_body(extend_chosen, Case{1, static_cast<int>(dt), D, G}, extend_bodies).fn;
}

template <typename Fn>
void set_body(std::map<Case, Named<Fn>>& chosen, const Case& c, const std::vector<Named<Fn>>& bodies,
              const std::string& name) {
  std::lock_guard<std::mutex> lock(chosen_mutex);
  if (name.empty()) {
    chosen.erase(c);
    return;
  }
  for (const auto& b : bodies)
    if (name == b.name) chosen[c] = b;
}

// ---------------------------------------------------------------- host side
Args make_args(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& page_table, double scale, int64_t window, at::Tensor& out) {
  Args a;
  a.q = q.data_ptr();
  a.q_s0 = q.stride(0);
  a.q_s1 = q.stride(1);
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.k_s0 = k_cache.stride(0);
  a.k_s1 = k_cache.stride(1);
  a.v_s0 = v_cache.stride(0);
  a.v_s1 = v_cache.stride(1);
  a.pt = page_table.data_ptr();
  a.pt64 = page_table.scalar_type() == at::kLong;
  a.pt_s0 = page_table.stride(0);
  a.pt_s1 = page_table.stride(1);
  a.Hq = q.size(1);
  a.Hkv = k_cache.size(1);
  a.G = a.Hq / a.Hkv;
  a.D = q.size(2);
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr();
  TORCH_CHECK(a.D <= kMaxScratchD, "head_dim ", a.D, " is larger than the supported ", kMaxScratchD);
  return a;
}

std::vector<int64_t> to_vec(const at::Tensor& t) {
  auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void check_rows(const std::vector<int64_t>& rows, const std::vector<int64_t>& lens, const at::Tensor& page_table) {
  for (size_t b = 0; b < rows.size(); ++b) {
    TORCH_CHECK(rows[b] >= 0 && rows[b] < page_table.size(0), "table_idx[", b, "] = ", rows[b],
                " is outside the page table's ", page_table.size(0), " rows");
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= page_table.size(1), "seq_lens[", b, "] = ", lens[b],
                " is outside [0, ", page_table.size(1), "]");
  }
}

// Below this many multiply-adds a call runs on the calling thread: waking a sleeping worker costs more than
// the work, and on a busy machine the wake-up can wait for a whole scheduler time slice.
constexpr int64_t kSerialMacs = int64_t(1) << 18;

// Run tasks (sorted by decreasing cost) on all threads, each thread taking the next one when it is free.
template <typename F>
void run_dynamic(int64_t ntasks, int64_t macs, int64_t max_M, int64_t D, int64_t G, F&& fn, int64_t group = 1) {
  std::atomic<int64_t> next{0};
  const int64_t nthreads = macs < kSerialMacs ? 1 : std::min<int64_t>(at::get_num_threads(), ntasks);
  if (nthreads <= 1) {
    Scratch sc(max_M, D, G);
    for (int64_t t = 0; t < ntasks; ++t) fn(t, sc);
    release_amx();
    return;
  }
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    Scratch sc(max_M, D, G);
    take_tasks(next, ntasks, group, [&](int64_t t) { fn(t, sc); });
    release_amx();   // where a task ran on AMX (attention_amx.h)
  });
}

}  // namespace

std::string isa_name() {
  switch (best_isa()) {
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "baseline";
  }
}

}  // namespace cpu

std::string cpu_isa() { return cpu::isa_name(); }

namespace {
int kind_named(const std::string& kind) {
  TORCH_CHECK(kind == "decode" || kind == "extend", "attention kind must be 'decode' or 'extend', got '", kind, "'");
  return kind == "decode" ? 0 : 1;
}
at::ScalarType dtype_named(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "bfloat16") return at::kBFloat16;
  if (dtype == "float16") return at::kHalf;
  TORCH_CHECK(false, "attention dtype must be 'float32', 'bfloat16' or 'float16', got '", dtype, "'");
}
}  // namespace

std::vector<std::string> attention_bodies(const std::string& kind, const std::string& dtype, int64_t head_dim,
                                          int64_t group) {
  TORCH_CHECK(head_dim >= 1 && group >= 1, "head_dim and group must be >= 1, got ", head_dim, " and ", group);
  std::vector<std::string> names;
  const auto dt = dtype_named(dtype);
  if (kind_named(kind) == 0)
    for (const auto& b : cpu::decode_bodies(dt, head_dim, group)) names.push_back(b.name);
  else
    for (const auto& b : cpu::extend_bodies(dt, head_dim, group)) names.push_back(b.name);
  return names;
}

void use_attention_body(const std::string& kind, const std::string& dtype, int64_t head_dim, int64_t group,
                        const std::string& name) {
  const auto names = attention_bodies(kind, dtype, head_dim, group);
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  TORCH_CHECK(name.empty() || std::find(names.begin(), names.end(), name) != names.end(), kind, " attention body '",
              name, "' does not run here for ", dtype, ", head_dim ", head_dim, ", group ", group, " (these do: ",
              known, ")");
  const auto dt = dtype_named(dtype);
  const cpu::Case c{kind_named(kind), static_cast<int>(dt), head_dim, group};
  if (std::get<0>(c) == 0) cpu::set_body(cpu::decode_chosen, c, cpu::decode_bodies(dt, head_dim, group), name);
  else cpu::set_body(cpu::extend_chosen, c, cpu::extend_bodies(dt, head_dim, group), name);
}

std::string attention_body(const std::string& kind, const std::string& dtype, int64_t head_dim, int64_t group) {
  TORCH_CHECK(head_dim >= 1 && group >= 1, "head_dim and group must be >= 1, got ", head_dim, " and ", group);
  const auto dt = dtype_named(dtype);
  const cpu::Case c{kind_named(kind), static_cast<int>(dt), head_dim, group};
  return std::get<0>(c) == 0 ? cpu::chosen_body(cpu::decode_chosen, c, cpu::decode_bodies).name
                             : cpu::chosen_body(cpu::extend_chosen, c, cpu::extend_bodies).name;
}

namespace cpu {

struct DecodeAttentionPlan::Impl {
  Args a;
  at::ScalarType dtype;
  DecodeFn fn;
  int64_t B = 0, macs = 0, part_size = 0, group = 1;
  std::vector<DecodeTask> tasks;        // longest first
  std::vector<int64_t> first_part;      // parts of pair bh: [first_part[bh], first_part[bh + 1])
  std::vector<int64_t> split_pairs;     // pairs with more than one part: merged after all tasks
  std::vector<float> parts;             // per part: G maxima, G sums, G x D accumulators
  std::vector<std::unique_ptr<Scratch>> scratch;  // one per thread of an in-region run (see run_task)

  // Merge the partial softmax states of one (request, head) and write its G output rows. A pair with a
  // single part (the common case) is finished by the thread that computed it, right after its task; only
  // split pairs need the second pass.
  template <typename scalar_t>
  void finish(int64_t bh, float* acc) const {
    const int64_t G = a.G, D = a.D;
    scalar_t* o = static_cast<scalar_t*>(a.out);
    const int64_t b = bh / a.Hkv, h = bh % a.Hkv, p0 = first_part[bh], p1 = first_part[bh + 1];
    for (int64_t g = 0; g < G; ++g) {
      float mmax = kNegInf;
      for (int64_t q = p0; q < p1; ++q) mmax = std::max(mmax, parts[q * part_size + g]);
      float lsum = 0.f;
      std::fill(acc, acc + D, 0.f);
      for (int64_t q = p0; q < p1; ++q) {
        const float* part = parts.data() + q * part_size;
        const float w = std::exp(part[g] - mmax);
        lsum += w * part[G + g];
        const float* pa = part + 2 * G + g * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += w * pa[d];
      }
      from_f32(acc, o + (b * a.Hq + h * G + g) * D, static_cast<int>(D), 1.f / lsum);
    }
  }
  void finish_any(int64_t bh, float* acc) const {
    if (dtype == at::kFloat) finish<float>(bh, acc);
    else if (dtype == at::kBFloat16) finish<c10::BFloat16>(bh, acc);
    else finish<c10::Half>(bh, acc);
  }
  void task(int64_t t, Scratch& sc) {
    fn(a, tasks[t], parts.data(), sc);
    const int64_t bh = tasks[t].b * a.Hkv + tasks[t].h;
    if (first_part[bh + 1] - first_part[bh] == 1) finish_any(bh, sc.row.data());
  }
};

DecodeAttentionPlan::DecodeAttentionPlan(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& page_table, const at::Tensor& table_idx,
                                         const at::Tensor& seq_lens, double scale, int64_t sliding_window,
                                         const at::Tensor& out, int64_t threads)
    : impl_(new Impl) {
  Impl& p = *impl_;
  TORCH_CHECK(q.stride(2) == 1 && out.is_contiguous() && out.sizes() == q.sizes() &&
                  out.scalar_type() == q.scalar_type(),
              "decode attention plan: q must be contiguous in head_dim and out a contiguous tensor like q");
  p.B = q.size(0);
  const auto rows = to_vec(table_idx), lens = to_vec(seq_lens);
  check_rows(rows, lens, page_table);
  at::Tensor o = out;
  p.a = make_args(q, k_cache, v_cache, page_table, scale, sliding_window, o);
  p.dtype = q.scalar_type();
  p.fn = pick_decode(p.dtype, p.a.D, p.a.G);
  for (int64_t b = 0; b < p.B; ++b) TORCH_CHECK(lens[b] >= 1, "seq_lens[", b, "] must be >= 1 for decode");
  // Every request's keys are cut into span / kSplitKeys chunks of equal length (at least one), whatever the batch:
  // the chunks, and so the order of every sum, depend on the request alone, and its output is the same bits in a
  // step of one request and of sixty-four. (Cutting only when the batch had too few pairs to feed the threads
  // made a request's output move with its neighbours; quantized weights turn such a rounding into a step of an
  // int8 activation, 0.05 in a log-probability.) A long request alone still feeds every thread.
  const Args& a = p.a;
  const int64_t pairs = p.B * a.Hkv;
  p.first_part.assign(pairs + 1, 0);
  int64_t nparts = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t L = lens[b];
    const int64_t k0 = sliding_window > 0 ? std::max<int64_t>(0, L - sliding_window) : 0;
    const int64_t span = L - k0;
    const int64_t even = std::max<int64_t>(1, span / kSplitKeys), chunk = (span + even - 1) / even;
    const int64_t chunks = (span + chunk - 1) / chunk;
    for (int64_t h = 0; h < a.Hkv; ++h) p.first_part[b * a.Hkv + h] = nparts + h * chunks;
    // the KV heads of one key chunk next to each other: a slot holds every head's row, so they read the same pages
    for (int64_t i = 0; i < chunks; ++i)
      for (int64_t h = 0; h < a.Hkv; ++h)
        p.tasks.push_back({b, rows[b], h, k0 + i * chunk, std::min(L, k0 + (i + 1) * chunk), nparts + h * chunks + i});
    nparts += a.Hkv * chunks;
  }
  // With enough tasks, a thread takes a request's heads together and finds their pages in its cache (a 48 x 260
  // step's attention: 19.7 -> 16.5 ms on AMX, 24.0 -> 19.6 capped, benchmarks/bench_kernels.py --step-only).
  p.group = nparts >= 4 * threads * a.Hkv ? a.Hkv : 1;
  p.first_part[pairs] = nparts;
  std::stable_sort(p.tasks.begin(), p.tasks.end(),
                   [](const DecodeTask& x, const DecodeTask& y) { return x.k1 - x.k0 > y.k1 - y.k0; });
  p.part_size = a.G * (a.D + 2);
  p.parts.resize(nparts * p.part_size);
  for (int64_t bh = 0; bh < pairs; ++bh)
    if (p.first_part[bh + 1] - p.first_part[bh] > 1) p.split_pairs.push_back(bh);
  for (const auto& t : p.tasks) p.macs += (t.k1 - t.k0) * a.G * a.D;
  for (int64_t t = 0; t < std::max<int64_t>(1, threads); ++t) p.scratch.emplace_back(new Scratch(a.G, a.D, a.G));
}

DecodeAttentionPlan::~DecodeAttentionPlan() = default;

void DecodeAttentionPlan::bind(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  Args& a = impl_->a;
  a.k = k_cache.data_ptr();
  a.v = v_cache.data_ptr();
  a.k_s0 = k_cache.stride(0);
  a.k_s1 = k_cache.stride(1);
  a.v_s0 = v_cache.stride(0);
  a.v_s1 = v_cache.stride(1);
}

int64_t DecodeAttentionPlan::num_tasks() const { return static_cast<int64_t>(impl_->tasks.size()); }
int64_t DecodeAttentionPlan::task_group() const { return impl_->group; }
int64_t DecodeAttentionPlan::num_split_pairs() const { return static_cast<int64_t>(impl_->split_pairs.size()); }

void DecodeAttentionPlan::run_task(int64_t t, int64_t thread) { impl_->task(t, *impl_->scratch[thread]); }

void DecodeAttentionPlan::finish_split(int64_t i, int64_t thread) {
  impl_->finish_any(impl_->split_pairs[i], impl_->scratch[thread]->row.data());
}

void DecodeAttentionPlan::run(const at::Tensor& k_cache, const at::Tensor& v_cache, bool parallel) {
  Impl& p = *impl_;
  bind(k_cache, v_cache);
  const int64_t ntasks = num_tasks();
  if (parallel) {
    run_dynamic(ntasks, p.macs, p.a.G, p.a.D, p.a.G, [&](int64_t t, Scratch& sc) { p.task(t, sc); }, p.group);
    if (!p.split_pairs.empty())
      at::parallel_for(0, num_split_pairs(), 16, [&](int64_t begin, int64_t end) {
        std::vector<float> acc(p.a.D);
        for (int64_t i = begin; i < end; ++i) p.finish_any(p.split_pairs[i], acc.data());
      });
  } else {
    for (int64_t t = 0; t < ntasks; ++t) run_task(t, 0);
    for (int64_t i = 0; i < num_split_pairs(); ++i) finish_split(i, 0);
  }
}

}  // namespace cpu

at::Tensor decode_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& page_table, const at::Tensor& table_idx,
                                const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  using namespace cpu;
  auto q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t B = q.size(0);
  auto out = at::empty({B, q.size(1), q.size(2)}, q.options());
  if (B == 0) return out;
  DecodeAttentionPlan plan(q, k_cache, v_cache, page_table, table_idx, seq_lens, scale, sliding_window, out,
                           at::get_num_threads());
  plan.run(k_cache, v_cache, true);
  return out;
}

at::Tensor extend_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& page_table, const at::Tensor& table_idx,
                                const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale,
                                int64_t sliding_window) {
  using namespace cpu;
  auto q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t N = q.size(0);
  auto out = at::empty({N, q.size(1), q.size(2)}, q.options());
  const auto rows = to_vec(table_idx), lens = to_vec(seq_lens), exts = to_vec(extend_lens);
  check_rows(rows, lens, page_table);
  const int64_t B = static_cast<int64_t>(rows.size());
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(exts[b] >= 0 && exts[b] <= lens[b], "extend_lens[", b, "] = ", exts[b], " must lie in [0, seq_lens[",
                b, "] = ", lens[b], "]");
    total += exts[b];
  }
  TORCH_CHECK(total == N, "sum(extend_lens) = ", total, " but q has ", N, " rows");
  if (N == 0) return out;
  // A request with one new query (a decode row of a mixed step; a prompt's last token after a prefix hit) takes
  // the decode body, exactly as in a decode step: its output does not depend on whether its step was mixed.
  std::vector<int64_t> one_b, one_q;
  for (int64_t b = 0, q0 = 0; b < B; q0 += exts[b++])
    if (exts[b] == 1) one_b.push_back(b), one_q.push_back(q0);
  if (!one_b.empty()) {
    const auto b_idx = at::tensor(one_b, at::kLong), q_idx = at::tensor(one_q, at::kLong);
    out.index_copy_(0, q_idx, decode_attention_cpu(q.index_select(0, q_idx), k_cache, v_cache, page_table,
                                                   table_idx.index_select(0, b_idx), seq_lens.index_select(0, b_idx),
                                                   scale, sliding_window));
    if (static_cast<int64_t>(one_b.size()) == N) return out;
  }
  Args a = make_args(q, k_cache, v_cache, page_table, scale, sliding_window, out);
  const int64_t G = a.G;
  const int64_t block = std::max<int64_t>(1, 64 / G);  // queries per task: ~64 (query, head) rows
  std::vector<ExtendTask> tasks;
  int64_t q_begin = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b], ext = exts[b];
    if (ext == 1) {   // done above
      q_begin += ext;
      continue;
    }
    for (int64_t i0 = 0; i0 < ext; i0 += block)
      for (int64_t h = 0; h < a.Hkv; ++h) tasks.push_back({q_begin, rows[b], L, ext, h, i0, std::min(ext, i0 + block)});
    q_begin += ext;
  }
  auto task_cost = [&](const ExtendTask& t) {
    const int64_t p_first = t.L - t.ext + t.i0, p_last = t.L - t.ext + t.i1 - 1;
    const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, p_first - sliding_window + 1) : 0;
    return (t.i1 - t.i0) * (p_last + 1 - lo);
  };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const ExtendTask& x, const ExtendTask& y) { return task_cost(x) > task_cost(y); });
  const ExtendFn fn = pick_extend(q.scalar_type(), a.D, a.G);
  int64_t pairs = 0;
  for (const auto& t : tasks) pairs += task_cost(t);
  run_dynamic(static_cast<int64_t>(tasks.size()), pairs * G * a.D, block * G, a.D, G,
              [&](int64_t t, Scratch& sc) { fn(a, tasks[t], sc); });
  return out;
}

}  // namespace minisgl
