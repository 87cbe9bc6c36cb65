// rows.h -- the bf16 row kernels of fused.cpp on raw pointers, for a caller that has checked its tensors.
//
// decode.cpp's step runs them inside its parallel region on a few rows at a time: there the at::Tensor views and
// checks of the tensor ops (fused.cpp's public functions, which call these) cost more than the rows themselves
// (~2-4 us a call against ~0.1-0.3 us of arithmetic for one row of the default model). Rows are run in order on
// the calling thread; the rounding is that of the tensor ops, bit for bit.
#pragma once

#include <cstdint>

namespace minisgl::cpu {

// rms_norm of `rows` rows of n: out = T(T(x * rsqrt(mean(x^2) + eps)) * w); with res, first res = T(x + res) and
// the norm is of that sum (fused_add_rms_norm_). out may be x. buf: n floats of scratch.
void norm_bf16_rows(const uint16_t* x, int64_t xs, uint16_t* res, int64_t rs, const uint16_t* w, uint16_t* out,
                    int64_t os, int64_t rows, int64_t n, float eps, float* buf);

// silu_mul: out[:, :n] = T(T(silu(gate)) * up) for rows [gate | up] of 2n.
void silu_mul_bf16_rows(const uint16_t* gate_up, int64_t gs, uint16_t* out, int64_t os, int64_t rows, int64_t n);

// One layer's K/V cache: slot s, head h starts at k + s * k_s0 + h * k_s1 (the same for v).
struct KvSlots {
  uint16_t *k, *v;
  int64_t k_s0, k_s1, v_s0, v_s1;
};

// rope_store_kv_: rotates the q and k heads of each qkv row (positions pos, tables cos / sin [max_pos, D]) in
// place, then copies its k and v heads into slot loc[i]. Positions and slots must be in range.
void rope_store_kv_bf16_rows(uint16_t* qkv, int64_t qs, const int64_t* pos, const int64_t* loc, const uint16_t* cos,
                             const uint16_t* sin, const KvSlots& kv, int64_t rows, int64_t Hq, int64_t Hkv, int64_t D);

}  // namespace minisgl::cpu
