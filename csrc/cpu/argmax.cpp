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

// The same on 8 lanes (a CPU without AVX-512 took ~60 us in the plain loop for a 49152-word vocabulary, a
// twentieth of a small model's decode step). The lanes start from the first 8 entries, so a row of -inf still
// ends at index 0; the tail past the last full group of 8 is the plain loop's, where only a strictly greater
// entry moves the answer (its index is larger than any lane's).
__attribute__((target("avx2,fma"))) int64_t argmax_row_avx2(const float* x, int64_t n) {
  if (n < 8) return argmax_row_base(x, n);
  __m256 best = _mm256_loadu_ps(x);
  if (_mm256_movemask_ps(_mm256_cmp_ps(best, best, _CMP_UNORD_Q))) return argmax_row_base(x, n);
  __m256i where = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i idx = _mm256_add_epi32(where, _mm256_set1_epi32(8));
  const __m256i step = _mm256_set1_epi32(8);
  int64_t j = 8;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) return argmax_row_base(x, n);
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    where = _mm256_blendv_epi8(where, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  alignas(32) float b[8];
  alignas(32) int32_t w[8];
  _mm256_store_ps(b, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), where);
  int64_t at = w[0];
  float m = b[0];
  for (int i = 1; i < 8; ++i)
    if (b[i] > m || (b[i] == m && w[i] < at)) m = b[i], at = w[i];
  for (; j < n; ++j) {
    if (std::isnan(x[j])) return j;   // no NaN before j: the groups were checked
    if (x[j] > m) m = x[j], at = j;
  }
  return at;
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
  row = cpu::for_isa(argmax_row_avx512, argmax_row_avx2, argmax_row_base);
#endif
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row(xp + r * rs, n);
  });
  return out;
}

}  // namespace minisgl
