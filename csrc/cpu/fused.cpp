// fused.cpp -- small fused element-wise ops for the decoder layers on the CPU, so that one decode step runs
// a few C++ calls per layer instead of ~20 torch ops (each of which costs a dispatch and an allocation).
// Every op computes in fp32 and rounds to the tensor dtype at the same points as its torch reference in
// nbs/05_models.ipynb, so results match it (up to the order of the sum in RMSNorm).
//   rms_norm(x, weight, eps)                   -> T(T(x * rsqrt(mean(x^2) + eps)) * weight)
//   fused_add_rms_norm_(x, residual, weight, eps): residual = T(x + residual); x = rms_norm(residual)  (in place)
//   silu_mul(gate_up)                          -> T(T(silu(gate)) * up)   (gate_up = [gate | up])
//   rope_store_kv_(qkv, positions, cos, sin, k_cache, v_cache, out_loc, Hq, Hkv):
//       rotates the q and k heads of qkv [N, (Hq + 2 Hkv) * D] in place (neox style, cos = [c, c],
//       sin = [-s, s] tables [max_pos, D]: x' = T(T(x * cos) + roll(x, D/2) * sin)), then writes the
//       rotated k heads and the v heads of token i into slot out_loc[i] of k_cache / v_cache.
// Rows are independent; they are split over threads only when there are many (prefill): a decode step's
// single row is cheaper on the calling thread than waking the pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../ops.h"
#include "isa.h"
#include "rows.h"
#include "vec.h"

namespace minisgl {
namespace {

constexpr int64_t kGrain = 16;  // rows per task

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

// bf16 <-> fp32 on raw bits, round to nearest even (NaN stays NaN), as c10::BFloat16 does; written out so that
// loops over them vectorise (c10's conversions keep a loop scalar).
inline uint16_t bf16_round(float f) {
  const uint32_t b = __builtin_bit_cast(uint32_t, f);
  const uint32_t r = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7fc0) : uint16_t(r);
}
inline float bf16_float(uint16_t v) { return __builtin_bit_cast(float, uint32_t(v) << 16); }

void check_rows(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), fn, ": ", name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2, fn, ": ", name, " must be 2-D [rows, features], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, fn, ": ", name, " must be contiguous in its last dimension");
  auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, fn, ": ", name,
              " must be float32, bfloat16 or float16, got ", st);
}

void check_weight(const at::Tensor& w, const at::Tensor& x, const char* fn) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), fn,
              ": weight must be a contiguous CPU [", x.size(1), "] tensor, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), fn, ": weight dtype ", w.scalar_type(), " != x dtype ",
              x.scalar_type());
}

// One row: dst[j] = T(T(src[j] * r) * w[j]), r = rsqrt(mean(src^2) + eps), src already fp32.
template <typename T>
inline void norm_row(const float* __restrict src, const T* __restrict w, T* __restrict dst, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += src[j] * src[j];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(f32(static_cast<T>(src[j] * r)) * f32(w[j]));
}

template <typename F>
void for_rows(int64_t rows, F&& f) {
  if (rows <= kGrain) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, kGrain, f);
  }
}

// norm_row for bf16 on raw bits, so that both passes vectorise (with c10::BFloat16 they stayed scalar: 2048 rows
// of 576 took ~1.2 ms, ~10% of a prefill). With `res`, first res = bf16(x + res) and the norm is of that sum.
// `out` may be `x` (in place): x is read in the first pass only.
inline void norm_bf16_row(const uint16_t* x, uint16_t* res, const uint16_t* __restrict w, uint16_t* out,
                          float* __restrict buf, int64_t n, float eps) {
  float ss = 0.f;
  if (res != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t s = bf16_round(bf16_float(x[j]) + bf16_float(res[j]));
      res[j] = s;
      buf[j] = bf16_float(s);
      ss += buf[j] * buf[j];
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < n; ++j) {
      buf[j] = bf16_float(x[j]);
      ss += buf[j] * buf[j];
    }
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = bf16_round(bf16_float(bf16_round(buf[j] * r)) * bf16_float(w[j]));
}

using NormRow = cpu::RowKernel<norm_bf16_row>;  // compiled per ISA (isa.h; MINISGL_CPU_ISA caps all)

}  // namespace

void cpu::norm_bf16_rows(const uint16_t* x, int64_t xs, uint16_t* res, int64_t rs, const uint16_t* w, uint16_t* out,
                         int64_t os, int64_t rows, int64_t n, float eps, float* buf) {
  const auto row = NormRow::pick();
  for (int64_t i = 0; i < rows; ++i) row(x + i * xs, res ? res + i * rs : nullptr, w, out + i * os, buf, n, eps);
}

namespace {

// The bf16 rows of rms_norm (res null, out a new tensor) and fused_add_rms_norm_ (out = x).
void norm_bf16_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight, at::Tensor& out, double eps) {
  const int64_t n = x.size(1), xs = x.stride(0), os = out.stride(0), rs = residual ? residual->stride(0) : 0;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  uint16_t* rp = residual ? reinterpret_cast<uint16_t*>(residual->data_ptr()) : nullptr;
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(x.size(0), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    cpu::norm_bf16_rows(xp + r0 * xs, xs, rp ? rp + r0 * rs : nullptr, rs, wp, op + r0 * os, os, r1 - r0, n,
                        static_cast<float>(eps), buf.data());
  });
}

}  // namespace

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm", "x");
  check_weight(weight, x, "rms_norm");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (x.scalar_type() == at::kBFloat16) {
    norm_bf16_rows(x, nullptr, weight, out, eps);
    return out;
  }
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(n);
      for (int64_t i = r0; i < r1; ++i) {
        for (int64_t j = 0; j < n; ++j) buf[j] = f32(xp[i * xs + j]);
        norm_row(buf.data(), wp, op + i * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

void fused_add_rms_norm_cpu(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, "fused_add_rms_norm_", "x");
  check_rows(residual, "fused_add_rms_norm_", "residual");
  check_weight(weight, x, "fused_add_rms_norm_");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "fused_add_rms_norm_: x and residual must share shape and dtype, got ", x.sizes(), " ",
              x.scalar_type(), " and ", residual.sizes(), " ", residual.scalar_type());
  if (x.scalar_type() == at::kBFloat16) {
    norm_bf16_rows(x, &residual, weight, x, eps);
    return;
  }
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    for_rows(rows, [&](int64_t r0, int64_t r1) {
      std::vector<float> buf(n);
      for (int64_t i = r0; i < r1; ++i) {
        scalar_t* xr = xp + i * xs;
        scalar_t* rr = rp + i * rs;
        for (int64_t j = 0; j < n; ++j) {
          const scalar_t s = static_cast<scalar_t>(f32(xr[j]) + f32(rr[j]));
          rr[j] = s;
          buf[j] = f32(s);
        }
        norm_row(buf.data(), wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

namespace {

// silu_mul for bf16 rows, vectorised: silu(x) = x * sigmoid(x) with e = exp(-|x|) from `exp_neg` (vec.h,
// ~1e-7 relative error; std::exp does not vectorise), sigmoid = 1 / (1 + e) for x >= 0 and e / (1 + e) below,
// and bf16 rounding to nearest even written out so that the loop vectorises (NaN stays NaN). Compiled for
// AVX-512 and AVX2 and picked at run time; a row of 1536 took ~8 us with scalar std::exp, ~1 us here.

using cpu::exp_neg;
using cpu::kNegInf;

inline void silu_mul_bf16_row(const uint16_t* __restrict g, const uint16_t* __restrict u, uint16_t* __restrict o,
                              int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = bf16_float(g[j]);
    const float h = exp_neg(0.5f * (x < 0.f ? x : -x));  // exp(-|x| / 2): exact down to x = -174
    const float e = h * h;
    const float sig = (x < 0.f ? e : 1.f) / (1.f + e);
    // as torch's x / (1 + exp(-x)): -0 once exp(-x) overflows fp32, NaN at -inf
    const float s = x < -88.7228f ? (x == kNegInf ? std::numeric_limits<float>::quiet_NaN() : -0.f) : x * sig;
    const float sg = bf16_float(bf16_round(s));
    o[j] = bf16_round(sg * bf16_float(u[j]));
  }
}

using SiluRow = cpu::RowKernel<silu_mul_bf16_row>;

}  // namespace

std::string silu_isa() { return SiluRow::picked(); }

void cpu::silu_mul_bf16_rows(const uint16_t* gate_up, int64_t gs, uint16_t* out, int64_t os, int64_t rows, int64_t n) {
  const auto row = SiluRow::pick();
  for (int64_t i = 0; i < rows; ++i) row(gate_up + i * gs, gate_up + i * gs + n, out + i * os, n);
}

void silu_mul_out_cpu(const at::Tensor& gate_up, at::Tensor& out) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even last dimension, got ", gate_up.sizes());
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  check_rows(out, "silu_mul", "out");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == n && out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: out must be [", rows, ", ", n, "] of gate_up's dtype, got ", out.sizes());
  const int64_t os = out.stride(0);
  if (gate_up.scalar_type() == at::kBFloat16) {
    const uint16_t* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr());
    uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
    for_rows(rows, [&](int64_t r0, int64_t r1) { cpu::silu_mul_bf16_rows(gp + r0 * gs, gs, op + r0 * os, os, r1 - r0, n); });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {  // bf16 took the path above
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(rows, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0; i < r1; ++i) {
        const scalar_t* g = gp + i * gs;
        const scalar_t* u = g + n;
        scalar_t* o = op + i * os;
        for (int64_t j = 0; j < n; ++j) {
          const float x = f32(g[j]);
          const scalar_t sg = static_cast<scalar_t>(x / (1.f + std::exp(-x)));
          o[j] = static_cast<scalar_t>(f32(sg) * f32(u[j]));
        }
      }
    });
  });
}

at::Tensor silu_mul_cpu(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_mul", "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even last dimension, got ", gate_up.sizes());
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_out_cpu(gate_up, out);
  return out;
}

namespace {

// rope for the heads of one bf16 row, vectorised as silu's row is: each pair (j, j + D/2) rotates together, so the
// loop over j < D/2 has no shuffles; rounding as the generic loop below (a = T(x * cos), x' = T(a + rolled * sin)).
// The scalar loop with c10 conversions took ~150 us for 265 rows of 12 heads (~6% of a 265-token prefill).
inline void rope_bf16_heads(uint16_t* __restrict row, const uint16_t* __restrict c, const uint16_t* __restrict s,
                            int64_t heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* __restrict x = row + h * D;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = bf16_float(x[j]), x2 = bf16_float(x[j + half]);
      const float a1 = bf16_float(bf16_round(x1 * bf16_float(c[j])));
      const float a2 = bf16_float(bf16_round(x2 * bf16_float(c[j + half])));
      x[j] = bf16_round(a1 + x2 * bf16_float(s[j]));
      x[j + half] = bf16_round(a2 + x1 * bf16_float(s[j + half]));
    }
  }
}

using RopeRow = cpu::RowKernel<rope_bf16_heads>;

}  // namespace

void cpu::rope_store_kv_bf16_rows(uint16_t* qkv, int64_t qs, const int64_t* pos, const int64_t* loc,
                                  const uint16_t* cos, const uint16_t* sin, const KvSlots& kv, int64_t rows,
                                  int64_t Hq, int64_t Hkv, int64_t D) {
  const auto rope = RopeRow::pick();
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* row = qkv + i * qs;
    rope(row, cos + pos[i] * D, sin + pos[i] * D, Hq + Hkv, D);
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(kv.k + loc[i] * kv.k_s0 + h * kv.k_s1, row + (Hq + h) * D, 2 * D);
      std::memcpy(kv.v + loc[i] * kv.v_s0 + h * kv.v_s1, row + (Hq + Hkv + h) * D, 2 * D);
    }
  }
}

void rope_store_kv_cpu(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                       at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& out_loc, int64_t num_q_heads,
                       int64_t num_kv_heads) {
  const char* fn = "rope_store_kv_";
  check_rows(qkv, fn, "qkv");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(), fn,
              ": k_cache and v_cache must both be [num_slots, Hkv, D], got ", k_cache.sizes(), " and ",
              v_cache.sizes());
  const int64_t N = qkv.size(0), D = k_cache.size(2), slots = k_cache.size(0);
  TORCH_CHECK(num_q_heads >= 1 && num_kv_heads == k_cache.size(1), fn, ": num_kv_heads ", num_kv_heads,
              " must match k_cache's ", k_cache.size(1), " and num_q_heads must be >= 1");
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * D, fn, ": qkv must be [N, (Hq + 2 Hkv) * D] = [N, ",
              (num_q_heads + 2 * num_kv_heads) * D, "], got ", qkv.sizes());
  TORCH_CHECK(D % 2 == 0, fn, ": head_dim must be even, got ", D);
  for (const auto* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == qkv.scalar_type() && t->stride(2) == 1, fn,
                ": caches must be CPU tensors of qkv's dtype, contiguous in head_dim");
  }
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->size(1) == D && t->is_contiguous() &&
                    t->scalar_type() == qkv.scalar_type(),
                fn, ": cos and sin must be contiguous [max_pos, D] tables of qkv's dtype, got ", t->sizes());
  }
  for (const auto* t : {&positions, &out_loc}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 1 && t->size(0) == N &&
                    (t->scalar_type() == at::kLong || t->scalar_type() == at::kInt),
                fn, ": positions and out_loc must be 1-D int32/int64 CPU tensors of N = ", N, " entries");
  }
  if (N == 0) return;
  auto pos = positions.to(at::kLong).contiguous();
  auto loc = out_loc.to(at::kLong).contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* lp = loc.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < N; ++i) {  // a bad index would be a silent out-of-bounds read or write
    TORCH_CHECK(pp[i] >= 0 && pp[i] < max_pos, fn, ": position ", pp[i], " outside [0, ", max_pos, ")");
    TORCH_CHECK(lp[i] >= 0 && lp[i] < slots, fn, ": out_loc ", lp[i], " outside [0, ", slots, ")");
  }
  const int64_t Hq = num_q_heads, Hkv = num_kv_heads, half = D / 2, qs = qkv.stride(0);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  if (qkv.scalar_type() == at::kBFloat16) {
    uint16_t* base = reinterpret_cast<uint16_t*>(qkv.data_ptr());
    const uint16_t* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr());
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(sin.data_ptr());
    const cpu::KvSlots kv{reinterpret_cast<uint16_t*>(k_cache.data_ptr()), reinterpret_cast<uint16_t*>(v_cache.data_ptr()),
                          ks0, ks1, vs0, vs1};
    for_rows(N, [&](int64_t r0, int64_t r1) {
      cpu::rope_store_kv_bf16_rows(base + r0 * qs, qs, pp + r0, lp + r0, cp, sp, kv, r1 - r0, Hq, Hkv, D);
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, qkv.scalar_type(), "rope_store_kv_", [&] {  // bf16 took the path above
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for_rows(N, [&](int64_t r0, int64_t r1) {
      std::vector<float> c(D), s(D), x(D);
      for (int64_t i = r0; i < r1; ++i) {
        scalar_t* row = base + i * qs;
        for (int64_t j = 0; j < D; ++j) c[j] = f32(cp[pp[i] * D + j]), s[j] = f32(sp[pp[i] * D + j]);
        for (int64_t h = 0; h < Hq + Hkv; ++h) {
          scalar_t* hd = row + h * D;
          for (int64_t j = 0; j < D; ++j) x[j] = f32(hd[j]);
          for (int64_t j = 0; j < D; ++j) {
            const float a = f32(static_cast<scalar_t>(x[j] * c[j]));
            const float rolled = x[j < half ? j + half : j - half];
            hd[j] = static_cast<scalar_t>(a + rolled * s[j]);
          }
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          std::memcpy(kc + lp[i] * ks0 + h * ks1, row + (Hq + h) * D, sizeof(scalar_t) * D);
          std::memcpy(vc + lp[i] * vs0 + h * vs1, row + (Hq + Hkv + h) * D, sizeof(scalar_t) * D);
        }
      }
    });
  });
}

}  // namespace minisgl
