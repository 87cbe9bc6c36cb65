// argmax.cpp -- greedy sampling's argmax over the rows of fp32 logits, as torch's `logits.max(-1).indices`: the
// first index of the largest value, or of the first NaN where a row has one (torch's max propagates NaN).
// torch's max-with-indices kept a 48-request decode step's [48, 49152] logits 1.5 ms (as long as its LM head
// takes to write them); its plain max (amax) was 10x faster. Here 16 lanes keep the largest value each has seen
// and where (strictly greater replaces, so each lane keeps its first), and the lanes are reduced at the end.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

#include "../ops.h"
#include "isa.h"

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace minisgl {
namespace {

int64_t argmax_row_base(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 0; j < n; ++j) {
    if (std::isnan(x[j])) return j;
    if (x[j] > x[best]) best = j;
  }
  return best;
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* x, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  __m512i where = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mk = n - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - j)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, mk, x + j);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return argmax_row_base(x, n);  // a NaN: rare, the plain loop
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    where = _mm512_mask_mov_epi32(where, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  const float m = _mm512_reduce_max_ps(best);
  // the smallest index among the lanes holding the maximum (a row of -inf: every lane, index 0)
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at, where);
}
#endif

}  // namespace

at::Tensor argmax_rows_cpu(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "argmax_rows: logits must be a 2-D float32 CPU tensor, got ", logits.scalar_type(), " ", logits.sizes());
  TORCH_CHECK(logits.size(1) >= 1 && logits.size(1) < (int64_t(1) << 31),
              "argmax_rows: rows must have 1 to 2^31 - 1 entries, got ", logits.size(1));
  const auto x = logits.stride(1) == 1 ? logits : logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1), rs = x.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  auto row = argmax_row_base;
#if defined(__GNUC__) && defined(__x86_64__)
  if (cpu::best_isa() >= cpu::Isa::avx512) row = argmax_row_avx512;
#endif
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row(xp + r * rs, n);
  });
  return out;
}

}  // namespace minisgl
