// vec.h -- small fp32 helpers for the CPU kernels, written as plain loops that the compiler vectorises
// (`#pragma omp simd` permits reassociating the reductions). The kernels include this header inside
// functions compiled for several ISAs (see MINISGL_ISA_VARIANTS in attention.cpp), so everything here is
// `inline` and free of calls that would stop inlining.
#pragma once
// The vector-extension helpers below are always inlined into ISA-specific callers; silence the ABI note.
#pragma GCC diagnostic ignored "-Wpsabi"
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace minisgl::cpu {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// n elements of T -> fp32. bf16 is the top half of an fp32, so the widening is a shift.
template <typename T>
inline void to_f32(const T* __restrict src, float* __restrict dst, int n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, sizeof(float) * n);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = __builtin_bit_cast(float, uint32_t(s[i]) << 16);
  } else {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
  }
}

// A row of T as fp32: the row itself for fp32 data, else its conversion in `buf`.
template <typename T>
inline const float* row_f32(const T* src, float* buf, int n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    to_f32(src, buf, n);
    return buf;
  }
}

template <typename T>
inline void from_f32(const float* __restrict src, T* __restrict dst, int n, float mul = 1.f) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

// Asks for n elements into the L2 cache (prefetcht2), not the L1: the decode attention's next tile of rows asked into
// the L1 filled the core's few L1 miss buffers, and the loads of the tile being computed queued behind them (a 48 x 260
// step, 30 layers, bench_kernels.py --step-only: 25.9 -> 19.2 ms, medians of 3 alternating runs; one request
// after 2000 keys: about 150 -> 100 us a layer; on an AMD EPYC Zen 4, AVX-512 and AVX2 bodies alike).
template <typename T>
inline void prefetch_row(const T* p, int n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int off = 0; off < n * static_cast<int>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 1);
}

template <int kD>
inline float dot(const float* __restrict a, const float* __restrict b, int D) {
  const int n = kD > 0 ? kD : D;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <int kD>
inline void axpy(float* __restrict y, float a, const float* __restrict x, int D) {
  const int n = kD > 0 ? kD : D;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

template <int kD>
inline void scale_row(float* __restrict y, float a, int D) {
  const int n = kD > 0 ? kD : D;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// exp(x) for x <= 0 (softmax arguments), relative error ~1e-7, vectorisable: exp(x) = 2^k * 2^f with
// k = round(x*log2(e)), |f| <= 1/2, and 2^f from its degree-7 Taylor polynomial. Below -87 it returns ~0.
inline float exp_neg(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float r = (t + 12582912.f) - 12582912.f;  // round to nearest without SSE4.1
  const float f = (t - r) * 0.693147180559945309f;
  float p = 1.f / 5040.f;
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t k = static_cast<int32_t>(r);
  return p * __builtin_bit_cast(float, uint32_t(k + 127) << 23);
}

#if defined(__GNUC__) && defined(__x86_64__)
// exp_neg for 16 lanes (the same polynomial), in intrinsics, for kernels that keep their values in registers, where a
// loop for the compiler to vectorise cannot reach them (the bf16 extend bodies' softmax, attention_bf16.h).
__attribute__((target("avx512f"))) inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 r = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, r), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, r);  // p * 2^r
}

#endif

// p[j] = exp(s[j] - m) for j < n; returns sum(p).
inline float exp_sum(float* __restrict s, float m, int n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    const float p = exp_neg(s[j] - m);
    s[j] = p;
    sum += p;
  }
  return sum;
}

inline float max_of(const float* __restrict s, int n) {
  float m = kNegInf;
#pragma omp simd reduction(max : m)
  for (int j = 0; j < n; ++j) m = s[j] > m ? s[j] : m;
  return m;
}

}  // namespace minisgl::cpu

namespace minisgl::cpu {

// A register-blocked multiply-add, the core of the extend kernel:
//   O[r, c] (+)= sum_{k in [k0, k1)} A[r, k] * Bm[k, c]     for r < rows, c < ncols
// with R rows x C vectors of W floats held in registers (GCC/Clang vector extensions, so the same source
// becomes zmm code in the AVX-512 variant and xmm code in the baseline). ncols must be a multiple of C*W.
template <int W>
struct VecT {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};

template <int W>
inline typename VecT<W>::type vload(const float* p) {
  typename VecT<W>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <int W>
inline void vstore(float* p, typename VecT<W>::type v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int W, int R, int C>
inline void gemm_tile(const float* __restrict A, int lda, const float* __restrict Bm, int ldb, int k0, int k1,
                      float* __restrict O, int ldo, int c0, bool accumulate) {
  using V = typename VecT<W>::type;
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = accumulate ? vload<W>(O + r * ldo + c0 + c * W) : V{};
  for (int k = k0; k < k1; ++k) {
    V b[C];
    for (int c = 0; c < C; ++c) b[c] = vload<W>(Bm + k * ldb + c0 + c * W);
    for (int r = 0; r < R; ++r) {
      const V a = V{} + A[r * lda + k];
      for (int c = 0; c < C; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore<W>(O + r * ldo + c0 + c * W, acc[r][c]);
}

template <int W, int R, int C>
inline void gemm(int rows, const float* A, int lda, const float* Bm, int ldb, int k0, int k1, float* O, int ldo,
                 int ncols, bool accumulate) {
  int r = 0;
  for (; r + R <= rows; r += R)
    for (int c0 = 0; c0 < ncols; c0 += C * W)
      gemm_tile<W, R, C>(A + r * lda, lda, Bm, ldb, k0, k1, O + r * ldo, ldo, c0, accumulate);
  for (; r < rows; ++r)
    for (int c0 = 0; c0 < ncols; c0 += C * W)
      gemm_tile<W, 1, C>(A + r * lda, lda, Bm, ldb, k0, k1, O + r * ldo, ldo, c0, accumulate);
}

// O[r, :] += sum_{k < n} A[r, k] * rows[k][:] for r < R: like gemm_tile, but the right-hand rows are
// given by pointers (K/V rows read straight from the paged cache).
template <int W, int R, int C>
inline void gemm_rows_tile(const float* __restrict A, int lda, const float* const* rows, int n, float* __restrict O,
                           int ldo, int c0) {
  using V = typename VecT<W>::type;
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = vload<W>(O + r * ldo + c0 + c * W);
  for (int k = 0; k < n; ++k) {
    V b[C];
    for (int c = 0; c < C; ++c) b[c] = vload<W>(rows[k] + c0 + c * W);
    for (int r = 0; r < R; ++r) {
      const V a = V{} + A[r * lda + k];
      for (int c = 0; c < C; ++c) acc[r][c] += a * b[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore<W>(O + r * ldo + c0 + c * W, acc[r][c]);
}

template <int W, int R, int C>
inline void gemm_rows(int nrows, const float* A, int lda, const float* const* rows, int n, float* O, int ldo,
                      int ncols) {
  int r = 0;
  for (; r + R <= nrows; r += R)
    for (int c0 = 0; c0 < ncols; c0 += C * W) gemm_rows_tile<W, R, C>(A + r * lda, lda, rows, n, O + r * ldo, ldo, c0);
  const int rest = nrows - r;
  for (int c0 = 0; c0 < ncols && rest > 0; c0 += C * W) {
    if (rest == 3) gemm_rows_tile<W, 3, C>(A + r * lda, lda, rows, n, O + r * ldo, ldo, c0);
    else if (rest == 2) gemm_rows_tile<W, 2, C>(A + r * lda, lda, rows, n, O + r * ldo, ldo, c0);
    else gemm_rows_tile<W, 1, C>(A + r * lda, lda, rows, n, O + r * ldo, ldo, c0);
  }
}

// W dot products at once: s[j] = <q, rows[j]> for j < W (rows[j] has D = nvec * W floats). Each product
// vector is reduced by a transposing tree (log2 W levels of shuffle + add) that sums W vectors into one
// vector of W sums, instead of W separate horizontal reductions.
template <int W, int g, size_t... I>
inline typename VecT<W>::type fold_level(typename VecT<W>::type a, typename VecT<W>::type b,
                                         std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, (2 * g * (I / g) + I % g)...) +
         __builtin_shufflevector(a, b, (2 * g * (I / g) + I % g + g)...);
}

template <int W, int g>
inline void fold_all(typename VecT<W>::type* v, int count) {
  // count vectors -> count / 2 vectors, each lane group of size g summed with its neighbour group
  for (int i = 0; i < count / 2; ++i) v[i] = fold_level<W, g>(v[2 * i], v[2 * i + 1], std::make_index_sequence<W>{});
  if constexpr (g > 1) fold_all<W, g / 2>(v, count / 2);
}

template <int W>
inline void dots(const float* __restrict q, const float* const* rows, float* __restrict s, int nvec) {
  using V = typename VecT<W>::type;
  V p[W];
  for (int j = 0; j < W; ++j) {
    V acc = V{};
    for (int c = 0; c < nvec; ++c) acc += vload<W>(q + c * W) * vload<W>(rows[j] + c * W);
    p[j] = acc;
  }
  fold_all<W, W / 2>(p, W);
  vstore<W>(s, p[0]);
}

#if defined(__GNUC__) && defined(__x86_64__)
// s[g * lds + j] = <q + g * D, rows[j]> for NH <= 3 heads g and 4 rows (keys) j (D a multiple of 8), on AVX2: each 8
// floats of a row are loaded (bf16: widened in registers) once for the NH heads, where `dots` reads a bf16 row widened
// in scratch once per head; each head's 4 product vectors reduce to 4 sums by two levels of horizontal adds and one
// 128-bit add.
template <int NH, typename T>
__attribute__((target("avx2,fma"))) inline void dots_4keys_avx2(const float* __restrict q, int D, const T* const* rows,
                                                                float* __restrict s, int lds) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "fp32 or bf16 rows");
  __m256 acc[NH][4];
  for (int g = 0; g < NH; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    for (int j = 0; j < 4; ++j) {
      __m256 k;
      if constexpr (std::is_same_v<T, float>) {
        k = _mm256_loadu_ps(rows[j] + c);
      } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + c));
        k = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      for (int g = 0; g < NH; ++g) acc[g][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), k, acc[g][j]);
    }
  }
  for (int g = 0; g < NH; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    _mm_storeu_ps(s + g * lds, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// O[g, :] += sum_{k < n} P[g * ldp + k] * rows[k][:] for NH <= 3 heads g (D a multiple of 16), on AVX2: 16 columns of
// the NH heads' sums stay in registers while the rows stream past, each row's 16 floats loaded (bf16: widened in
// registers) once for the NH heads, where `gemm_rows` reads bf16 rows widened in scratch.
template <int NH, typename T>
__attribute__((target("avx2,fma"))) inline void pv_avx2(const float* __restrict P, int ldp, const T* const* rows, int n,
                                                        float* __restrict O, int D) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>, "fp32 or bf16 rows");
  for (int c0 = 0; c0 < D; c0 += 16) {
    __m256 acc[NH][2];
    for (int g = 0; g < NH; ++g)
      for (int c = 0; c < 2; ++c) acc[g][c] = _mm256_loadu_ps(O + g * D + c0 + 8 * c);
    for (int k = 0; k < n; ++k) {
      __m256 v[2];
      for (int c = 0; c < 2; ++c) {
        if constexpr (std::is_same_v<T, float>) {
          v[c] = _mm256_loadu_ps(rows[k] + c0 + 8 * c);
        } else {
          const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[k] + c0 + 8 * c));
          v[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
      }
      for (int g = 0; g < NH; ++g) {
        const __m256 p = _mm256_broadcast_ss(P + g * ldp + k);
        for (int c = 0; c < 2; ++c) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(O + g * D + c0 + 8 * c, acc[g][c]);
  }
}

// The G query heads of a KV head three at a time (12 sums of `dots_4keys_avx2` and the 4 keys' vectors fill AVX2's
// 16 registers), then the two or one left: s[g * lds + j] = <q + g * D, rows[j]> for g < G, j < 4. A row is read
// once for every three heads.
template <typename T>
__attribute__((target("avx2,fma"))) inline void dots_4keys_gqa_avx2(const float* q, int G, int D, const T* const* rows,
                                                                    float* s, int lds) {
  int g = 0;
  for (; g + 3 <= G; g += 3) dots_4keys_avx2<3>(q + g * D, D, rows, s + g * lds, lds);
  if (G - g == 2) dots_4keys_avx2<2>(q + g * D, D, rows, s + g * lds, lds);
  else if (G - g == 1) dots_4keys_avx2<1>(q + g * D, D, rows, s + g * lds, lds);
}

// O[g, :] += sum_{k < n} P[g * ldp + k] * rows[k][:] for g < G, three heads at a time like `dots_4keys_gqa_avx2`.
template <typename T>
__attribute__((target("avx2,fma"))) inline void pv_gqa_avx2(const float* P, int ldp, int G, const T* const* rows, int n,
                                                            float* O, int D) {
  int g = 0;
  for (; g + 3 <= G; g += 3) pv_avx2<3>(P + g * ldp, ldp, rows, n, O + g * D, D);
  if (G - g == 2) pv_avx2<2>(P + g * ldp, ldp, rows, n, O + g * D, D);
  else if (G - g == 1) pv_avx2<1>(P + g * ldp, ldp, rows, n, O + g * D, D);
}
constexpr bool kMinisglX86 = true;
#else
constexpr bool kMinisglX86 = false;  // the AVX2 paths above exist on x86-64 only
#endif

}  // namespace minisgl::cpu
