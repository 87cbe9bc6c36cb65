// linear.cpp -- y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows of x (decode), W bf16 as stored.
//
// Decode multiplies a handful of activation rows by every weight matrix once per token, so the time goes
// into streaming W from memory; a general GEMM library (oneDNN) blocks for reuse that is not there and
// leaves bandwidth unused. This kernel walks W once, in its stored [N, K] layout:
//   - the N output features are split into contiguous blocks of rows, one range per thread (a GemvPlan,
//     gemv.h: at::parallel_for runs the parts here, decode.cpp runs them inside its own parallel region), so
//     each core streams its own part of W;
//   - avx512bf16 (the decode path here): one weight row at a time, front to back, so each thread reads
//     ONE sequential stream, software-prefetched kPfBytes ahead into L2 (the T1 hint; 16 KB ahead measured
//     ~29 GB/s on two cores against ~26 GB/s for 8 KB into L1 and ~26 GB/s with no prefetch); M x 2
//     accumulator chains, x from L1. Blocks of 2-8 interleaved rows streamed ~19 GB/s, oneDNN ~17 GB/s;
//   - the fp32 paths take R weight rows at a time with M x R accumulators in registers (R from M so the
//     block fits the register file), prefetching kPfRows rows ahead;
//   - fp32 accumulation, one horizontal sum per output, bias added, written in x's dtype by the kernel
//     itself (no fp32 buffer and no separate conversion pass).
// ISA variants, picked once at run time (MINISGL_CPU_ISA=avx512|avx2|baseline caps the choice, as for the
// attention kernels; the `isa` argument forces one for tests):
//   avx512bf16 : bf16 x, `vdpbf16ps` (32 bf16 products per instruction, pairs summed in fp32);
//   avx512     : bf16 -> fp32 by a 16-bit shift, fp32 FMA (fp32 x, or no AVX512_BF16);
//   avx2       : the same on 8 lanes;  baseline : plain loops.
// x may have any row stride; its last dim is made contiguous. M may be any size (blocks of 8 rows of x
// each re-stream W), but the kernel only pays for small M.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MINISGL_LIN_X86 1
#endif

#include <c10/util/BFloat16.h>

#include "../ops.h"
#include "gemv.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace minisgl {
namespace cpu {
namespace {

constexpr int kMaxM = kGemvMaxM;
constexpr int kPfRows = 16;      // software prefetch distance of the blocked kernels, in weight rows
constexpr int64_t kPfBytes = 16384;  // ... of the sequential bf16 kernel, in bytes

inline void store(const LinArgs& a, int m, int64_t n, float v) {
  if (a.yb) a.yb[m * a.ys + n] = c10::BFloat16(v).x;
  else a.y[m * a.ys + n] = a.y_rounded ? static_cast<float>(c10::BFloat16(v)) : v;
}

inline float bf16_to_f32(uint16_t v) { return __builtin_bit_cast(float, uint32_t(v) << 16); }

// Rows of W per block for M rows of x: M * R accumulators stay in registers.
constexpr int rows_for(int M) { return M <= 2 ? 8 : M <= 4 ? 4 : 2; }

// ---------------------------------------------------------------- baseline
template <int M>
void block_base(const LinArgs& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K;
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = a.w + n * K;
    float acc[M] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float wv = bf16_to_f32(wr[k]);
      for (int m = 0; m < M; ++m) acc[m] += wv * a.xf[m * K + k];
    }
    const float b = a.bias ? a.bias[n] : 0.f;
    for (int m = 0; m < M; ++m) store(a, m, n, acc[m] + b);
  }
}

#ifdef MINISGL_LIN_X86
#define MINISGL_T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define MINISGL_T512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))
#define MINISGL_T256 __attribute__((target("avx2,fma")))

template <typename T>
inline void prefetch_rows(const T* p, int64_t bytes) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// ---------------------------------------------------------------- avx512 + bf16 dot products
// One row of W at a time, read front to back (a single sequential stream per thread, which the hardware
// prefetcher follows best), two accumulator chains per row of x over alternating 32-column steps.
template <int M>
MINISGL_T512BF16 inline void seq_bf16dp(const LinArgs& a, int64_t n0, int64_t n1) {
  const int64_t K = a.K;
  const char* end = reinterpret_cast<const char*>(a.w + n1 * K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint16_t* wr = a.w + n * K;
    __m512 acc0[M], acc1[M];
    for (int m = 0; m < M; ++m) acc0[m] = acc1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      const char* p = reinterpret_cast<const char*>(wr + k) + kPfBytes;
      if (p < end) { _mm_prefetch(p, _MM_HINT_T1); _mm_prefetch(p + 64, _MM_HINT_T1); }
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
      for (int m = 0; m < M; ++m) {
        acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_loadu_si512(a.xb + m * a.xs + k), w0);
        acc1[m] = _mm512_dpbf16_ps(acc1[m], (__m512bh)_mm512_loadu_si512(a.xb + m * a.xs + k + 32), w1);
      }
    }
    for (; k < K; k += 32) {
      const __mmask32 mk = k + 32 <= K ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr + k);
      for (int m = 0; m < M; ++m)
        acc0[m] = _mm512_dpbf16_ps(acc0[m], (__m512bh)_mm512_maskz_loadu_epi16(mk, a.xb + m * a.xs + k), wv);
    }
    for (int m = 0; m < M; ++m)
      store(a, m, n, _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) + (a.bias ? a.bias[n] : 0.f));
  }
}

// ---------------------------------------------------------------- avx512, bf16 -> fp32 by shifting
MINISGL_T512 inline __m512 load_bf16x16(const uint16_t* p, __mmask16 mk) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p)), 16));
}

template <int M, int RR>
MINISGL_T512 inline void rows_f32_512(const LinArgs& a, int64_t n, int64_t n1) {
  const int64_t K = a.K, K16 = K / 16 * 16;
  const __mmask16 tail = K == K16 ? 0 : (__mmask16)((1u << (K - K16)) - 1u);
  const __mmask16 full = 0xffff;
  const uint16_t* wr = a.w + n * K;
  __m512 acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* pf = wr + kPfRows * K;
  const int64_t pf_end = (n1 - n - kPfRows) * K;
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = k < K16 ? full : tail;
    if ((k & 31) == 0)
      for (int r = 0; r < RR; ++r)
        if (r * K + k < pf_end) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
    __m512 wv[RR];
    for (int r = 0; r < RR; ++r) wv[r] = load_bf16x16(wr + r * K + k, mk);
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mk, a.xf + m * K + k);
      for (int r = 0; r < RR; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r)
      store(a, m, n + r, _mm512_reduce_add_ps(acc[m][r]) + (a.bias ? a.bias[n + r] : 0.f));
}

template <int M>
MINISGL_T512 inline void block_f32_512(const LinArgs& a, int64_t n0, int64_t n1) {
  constexpr int R = rows_for(M);
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_f32_512<M, R>(a, n, n1);
  for (; n < n1; ++n) rows_f32_512<M, 1>(a, n, n1);
}

// ---------------------------------------------------------------- avx2, bf16 -> fp32 by shifting
MINISGL_T256 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int M, int RR>
MINISGL_T256 inline void rows_f32_256(const LinArgs& a, int64_t n, int64_t n1) {
  const int64_t K = a.K, K8 = K / 8 * 8;
  const uint16_t* wr = a.w + n * K;
  __m256 acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = _mm256_setzero_ps();
  const uint16_t* pf = wr + kPfRows * K;
  const int64_t pf_end = (n1 - n - kPfRows) * K;
  int64_t k = 0;
  for (; k < K8; k += 8) {
    if ((k & 31) == 0)
      for (int r = 0; r < RR; ++r)
        if (r * K + k < pf_end) _mm_prefetch(reinterpret_cast<const char*>(pf + r * K + k), _MM_HINT_T0);
    __m256 wv[RR];
    for (int r = 0; r < RR; ++r)
      wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr + r * K + k))), 16));
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(a.xf + m * K + k);
      for (int r = 0; r < RR; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) {
      float s = hsum256(acc[m][r]);
      for (int64_t kk = k; kk < K; ++kk) s += bf16_to_f32(wr[r * K + kk]) * a.xf[m * K + kk];
      store(a, m, n + r, s + (a.bias ? a.bias[n + r] : 0.f));
    }
}

template <int M>
MINISGL_T256 inline void block_f32_256(const LinArgs& a, int64_t n0, int64_t n1) {
  constexpr int R = M <= 2 ? 4 : 2;  // 16 ymm registers
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_f32_256<M, R>(a, n, n1);
  for (; n < n1; ++n) rows_f32_256<M, 1>(a, n, n1);
}
#endif  // MINISGL_LIN_X86

// ---------------------------------------------------------------- dispatch
enum class LinIsa { base, avx2, avx512, avx512bf16 };

using BlockFn = GemvBlockFn;

template <template <int> class F>
BlockFn pick_m(int M) {
  switch (M) {
    case 1: return F<1>::fn;
    case 2: return F<2>::fn;
    case 3: return F<3>::fn;
    case 4: return F<4>::fn;
    case 5: return F<5>::fn;
    case 6: return F<6>::fn;
    case 7: return F<7>::fn;
    default: return F<8>::fn;
  }
}

template <int M> struct Base { static void fn(const LinArgs& a, int64_t n0, int64_t n1) { block_base<M>(a, n0, n1); } };
#ifdef MINISGL_LIN_X86
template <int M> struct Seq {
  MINISGL_T512BF16 static void fn(const LinArgs& a, int64_t n0, int64_t n1) { seq_bf16dp<M>(a, n0, n1); }
};
template <int M> struct F512 {
  MINISGL_T512 static void fn(const LinArgs& a, int64_t n0, int64_t n1) { block_f32_512<M>(a, n0, n1); }
};
template <int M> struct F256 {
  MINISGL_T256 static void fn(const LinArgs& a, int64_t n0, int64_t n1) { block_f32_256<M>(a, n0, n1); }
};
#endif

LinIsa machine_isa() {
#ifdef MINISGL_LIN_X86
  static const LinIsa isa = [] {
    __builtin_cpu_init();
    const char* cap = std::getenv("MINISGL_CPU_ISA");
    const std::string want = cap ? cap : "";
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (want == "baseline") return LinIsa::base;
    if (want == "avx2") return avx2 ? LinIsa::avx2 : LinIsa::base;
    if (bf16 && want != "avx512") return LinIsa::avx512bf16;
    if (avx512) return LinIsa::avx512;
    return avx2 ? LinIsa::avx2 : LinIsa::base;
  }();
  return isa;
#else
  return LinIsa::base;
#endif
}

const char* isa_str(LinIsa i) {
  switch (i) {
    case LinIsa::avx512bf16: return "avx512bf16";
    case LinIsa::avx512: return "avx512";
    case LinIsa::avx2: return "avx2";
    default: return "baseline";
  }
}

LinIsa resolve_isa(const std::string& req) {
  const LinIsa best = machine_isa();
  if (req.empty()) return best;
  LinIsa want;
  if (req == "avx512bf16") want = LinIsa::avx512bf16;
  else if (req == "avx512") want = LinIsa::avx512;
  else if (req == "avx2") want = LinIsa::avx2;
  else if (req == "baseline") want = LinIsa::base;
  else TORCH_CHECK(false, "linear_gemv: isa must be '', 'avx512bf16', 'avx512', 'avx2' or 'baseline', got '", req, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "linear_gemv: isa '", req,
              "' is not available here (best: ", isa_str(best), ")");
  return want;
}

}  // namespace

GemvPlan make_gemv_plan(const at::Tensor& weight, const float* bias, int64_t M, bool x_bf16, int64_t parts,
                        const std::string& isa) {
  const LinIsa level = resolve_isa(isa);
  GemvPlan p;
  p.w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  p.bias = bias;
  p.N = weight.size(0);
  p.K = weight.size(1);
  p.M = M;
  p.dp = level == LinIsa::avx512bf16 && x_bf16;
  for (int m = 1; m <= kMaxM; ++m) {
#ifdef MINISGL_LIN_X86
    if (p.dp) p.fns[m] = pick_m<Seq>(m);
    else if (level >= LinIsa::avx512) p.fns[m] = pick_m<F512>(m);
    else if (level == LinIsa::avx2) p.fns[m] = pick_m<F256>(m);
    else p.fns[m] = pick_m<Base>(m);
#else
    p.fns[m] = pick_m<Base>(m);
#endif
  }
  // Contiguous row ranges, a multiple of 8 rows, about equal per part; one part for a small W (< 64 KB).
  const int64_t bytes = p.N * p.K * 2;
  p.parts = std::max<int64_t>(1, std::min<int64_t>((p.N + 7) / 8, bytes < (64 << 10) ? 1 : parts));
  p.per = ((p.N + p.parts - 1) / p.parts + 7) / 8 * 8;
  return p;
}

void run_gemv_part(const GemvPlan& p, const void* x, int64_t xs, bool x_bf16, void* y, int64_t ys, YFormat yf,
                   int64_t part) {
  const int64_t n0 = part * p.per, n1 = std::min(p.N, n0 + p.per);
  if (n0 >= n1) return;
  thread_local std::vector<float> xbuf;  // bf16 x for the fp32 kernels
  const float* xf = static_cast<const float*>(x);
  int64_t xfs = xs;
  if (!p.dp && x_bf16) {
    xbuf.resize(static_cast<size_t>(p.M * p.K));
    const uint16_t* xb = static_cast<const uint16_t*>(x);
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < p.K; ++k) xbuf[m * p.K + k] = bf16_to_f32(xb[m * xs + k]);
    xf = xbuf.data();
    xfs = p.K;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += kMaxM) {
    LinArgs a;
    a.w = p.w;
    a.N = p.N;
    a.K = p.K;
    a.bias = p.bias;
    a.M = static_cast<int>(std::min<int64_t>(kMaxM, p.M - m0));
    if (p.dp) {
      a.xb = static_cast<const uint16_t*>(x) + m0 * xs;
      a.xs = xs;
    } else {
      a.xf = xf + m0 * xfs;  // fp32 rows are contiguous (xs == K, see gemv.h)
    }
    a.ys = ys;
    if (yf == YFormat::bf16) a.yb = static_cast<uint16_t*>(y) + m0 * ys;
    else a.y = static_cast<float*>(y) + m0 * ys;
    a.y_rounded = yf == YFormat::f32_bf16_rounded;
    p.fns[a.M](a, n0, n1);
  }
}

}  // namespace cpu

std::string linear_isa() { return cpu::isa_str(cpu::machine_isa()); }

at::Tensor linear_gemv_cpu(const at::Tensor& x_in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                           const std::string& isa) {
  using namespace cpu;
  TORCH_CHECK(x_in.dim() == 2, "linear_gemv: x must be 2-D [M, K], got ", x_in.sizes());
  TORCH_CHECK(weight.dim() == 2, "linear_gemv: weight must be 2-D [N, K], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_gemv: weight must be bfloat16, got ",
              weight.scalar_type());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "linear_gemv: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(x_in.size(1) == weight.size(1), "linear_gemv: x has K=", x_in.size(1), " columns but weight has K=",
              weight.size(1));
  TORCH_CHECK(x_in.device().is_cpu() && weight.device().is_cpu(), "linear_gemv: x and weight must be on the CPU");
  const int64_t M = x_in.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear_gemv: bias must be [N] = [", N, "], got ",
                bias->sizes());
    TORCH_CHECK(bias->device().is_cpu(), "linear_gemv: bias must be on the CPU");
    b = bias->to(at::kFloat).contiguous();
  }
  resolve_isa(isa);  // a bad name is an error even when there is nothing to compute
  auto out = at::empty({M, N}, x_in.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) {
    if (b.defined()) out.copy_(b.unsqueeze(0).expand({M, N}));
    else out.zero_();
    return out;
  }
  const auto w = weight.contiguous();
  const bool x_bf16 = x_in.scalar_type() == at::kBFloat16;
  // bf16 x: read in place (any row stride); fp32 x: contiguous rows
  const auto x = x_bf16 ? (x_in.stride(1) == 1 ? x_in : x_in.contiguous()) : x_in.contiguous();
  const GemvPlan p = make_gemv_plan(w, b.defined() ? b.data_ptr<float>() : nullptr, M, x_bf16,
                                    at::get_num_threads(), isa);
  const int64_t xs = x_bf16 ? x.stride(0) : K;
  at::parallel_for(0, p.parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      run_gemv_part(p, x.data_ptr(), xs, x_bf16, out.data_ptr(), N, x_bf16 ? YFormat::bf16 : YFormat::f32, t);
  });
  return out;
}

}  // namespace minisgl
