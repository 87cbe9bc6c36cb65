// attention.cu -- paged decode and extend (prefill) attention on CUDA: straightforward, correct kernels.
//
// Layouts (see common.h): q [N, Hq, D] (last dim contiguous), k_cache/v_cache [num_slots, Hkv, D] (last dim
// contiguous), page_table [rows, max_seq_len] int32|int64 (page_table[row, pos] = slot), table_idx /
// seq_lens / extend_lens [B]. Output [N, Hq, D] contiguous in q's dtype; fp32 accumulation; D <= 256.
//
// decode: one block per (request, kv head), kWarps warps. Warp w takes keys w, w + kWarps, ...; for each key
//   every lane forms a partial dot product over its dims (d = lane + 32 i) for each of the G query heads of
//   the group, a warp reduction gives the score, and the warp keeps an online softmax state (m, l, acc) in
//   shared memory. At the end the kWarps states are merged.
// extend: one block per (request, block of kQueries queries, query head). The block walks the visible keys
//   in tiles of kTile rows staged in shared memory (fp32); each warp owns kQueries / kWarps queries whose
//   q and accumulator live in registers (kMaxDpl = 8 dims per lane).
#include "../common.h"
#include "../ops.h"
#include "cuda_utils.cuh"

namespace minisgl {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxDpl = 8;  // D <= 32 * kMaxDpl
constexpr int kQueries = 16;
constexpr int kQpw = kQueries / kWarps;
constexpr int kTile = 16;  // 2 x 16 x 256 fp32 = 32 KiB of shared memory

struct Params {
  const void* q;
  int64_t q_s0, q_s1;
  const void* k;
  const void* v;
  int64_t k_s0, k_s1, v_s0, v_s1;
  const void* pt;
  bool pt64;
  int64_t pt_s0, pt_s1;
  const int64_t* table_idx;    // [B]
  const int64_t* seq_lens;     // [B]
  const int64_t* extend_lens;  // [B] (extend)
  const int64_t* qo_start;     // [B] first q row of each request (extend)
  int Hq, Hkv, G, D;
  int window;
  float scale;
  void* out;
};

template <typename T>
__global__ void decode_kernel(Params p) {
  extern __shared__ float smem[];
  const int b = blockIdx.x, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int G = p.G, D = p.D;
  float* q_sh = smem;                      // [G][D], pre-scaled
  float* acc_sh = q_sh + G * D;            // [kWarps][G][D]
  float* m_sh = acc_sh + kWarps * G * D;   // [kWarps][G]
  float* l_sh = m_sh + kWarps * G;         // [kWarps][G]
  const T* qb = static_cast<const T*>(p.q) + b * p.q_s0 + static_cast<int64_t>(h) * G * p.q_s1;
  for (int e = threadIdx.x; e < G * D; e += blockDim.x)
    q_sh[e] = to_float(qb[(e / D) * p.q_s1 + e % D]) * p.scale;
  for (int e = threadIdx.x; e < kWarps * G * D; e += blockDim.x) acc_sh[e] = 0.f;
  for (int e = threadIdx.x; e < kWarps * G; e += blockDim.x) {
    m_sh[e] = -INFINITY;
    l_sh[e] = 0.f;
  }
  __syncthreads();
  const int64_t L = p.seq_lens[b], row = p.table_idx[b];
  const int64_t k0 = p.window > 0 ? max(static_cast<int64_t>(0), L - p.window) : 0;
  const T* kc = static_cast<const T*>(p.k) + static_cast<int64_t>(h) * p.k_s1;
  const T* vc = static_cast<const T*>(p.v) + static_cast<int64_t>(h) * p.v_s1;
  float* acc_w = acc_sh + warp * G * D;
  for (int64_t pos = k0 + warp; pos < L; pos += kWarps) {
    const int64_t slot = slot_at(p.pt, p.pt64, p.pt_s0, p.pt_s1, row, pos);
    const T* kr = kc + slot * p.k_s0;
    const T* vr = vc + slot * p.v_s0;
    for (int g = 0; g < G; ++g) {
      float part = 0.f;
      for (int d = lane; d < D; d += 32) part += q_sh[g * D + d] * to_float(kr[d]);
      const float s = warp_sum(part);
      const float m_old = m_sh[warp * G + g];
      const float m_new = fmaxf(m_old, s);
      const float alpha = __expf(m_old - m_new);
      const float w = __expf(s - m_new);
      for (int d = lane; d < D; d += 32) acc_w[g * D + d] = acc_w[g * D + d] * alpha + w * to_float(vr[d]);
      __syncwarp();
      if (lane == 0) {
        m_sh[warp * G + g] = m_new;
        l_sh[warp * G + g] = l_sh[warp * G + g] * alpha + w;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.Hq + static_cast<int64_t>(h) * G) * D;
  for (int e = threadIdx.x; e < G * D; e += blockDim.x) {
    const int g = e / D;
    float m = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, m_sh[w * G + g]);
    float l = 0.f, o = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = m_sh[w * G + g] == -INFINITY ? 0.f : __expf(m_sh[w * G + g] - m);
      l += f * l_sh[w * G + g];
      o += f * acc_sh[w * G * D + e];
    }
    out[e] = static_cast<T>(o / l);
  }
}

template <typename T>
__global__ void extend_kernel(Params p) {
  __shared__ float k_sh[kTile][32 * kMaxDpl];
  __shared__ float v_sh[kTile][32 * kMaxDpl];
  const int b = blockIdx.y, hq = blockIdx.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t ext = p.extend_lens[b], L = p.seq_lens[b], row = p.table_idx[b];
  const int64_t i_block = static_cast<int64_t>(blockIdx.x) * kQueries;
  if (i_block >= ext) return;
  const int h = hq / p.G, D = p.D;
  const int64_t i_last = min(ext, i_block + kQueries) - 1;
  const int64_t p_first = L - ext + i_block, p_last = L - ext + i_last;
  const int64_t k_lo = p.window > 0 ? max(static_cast<int64_t>(0), p_first - p.window + 1) : 0;

  float q[kQpw][kMaxDpl], acc[kQpw][kMaxDpl], m[kQpw], l[kQpw];
  int64_t pos[kQpw];
#pragma unroll
  for (int t = 0; t < kQpw; ++t) {
    const int64_t i = i_block + warp * kQpw + t;
    pos[t] = i < ext ? L - ext + i : -1;  // -1: no query in this lane slot
    m[t] = -INFINITY;
    l[t] = 0.f;
    const T* qr = static_cast<const T*>(p.q) + (p.qo_start[b] + min(i, ext - 1)) * p.q_s0 + hq * p.q_s1;
#pragma unroll
    for (int c = 0; c < kMaxDpl; ++c) {
      const int d = lane + 32 * c;
      q[t][c] = d < D ? to_float(qr[d]) * p.scale : 0.f;
      acc[t][c] = 0.f;
    }
  }
  const T* kc = static_cast<const T*>(p.k) + static_cast<int64_t>(h) * p.k_s1;
  const T* vc = static_cast<const T*>(p.v) + static_cast<int64_t>(h) * p.v_s1;
  for (int64_t t0 = k_lo; t0 <= p_last; t0 += kTile) {
    const int n = static_cast<int>(min(static_cast<int64_t>(kTile), p_last + 1 - t0));
    __syncthreads();  // the previous tile is no longer read
    for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
      const int j = e / D, d = e % D;
      const int64_t slot = slot_at(p.pt, p.pt64, p.pt_s0, p.pt_s1, row, t0 + j);
      k_sh[j][d] = to_float(kc[slot * p.k_s0 + d]);
      v_sh[j][d] = to_float(vc[slot * p.v_s0 + d]);
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < kQpw; ++t) {
      if (pos[t] < 0) continue;
      const int64_t lo = p.window > 0 ? max(static_cast<int64_t>(0), pos[t] - p.window + 1) : 0;
      const int jlo = static_cast<int>(max(lo - t0, static_cast<int64_t>(0)));
      const int jhi = static_cast<int>(min(pos[t] - t0 + 1, static_cast<int64_t>(n)));
      for (int j = jlo; j < jhi; ++j) {
        float part = 0.f;
#pragma unroll
        for (int c = 0; c < kMaxDpl; ++c) {
          const int d = lane + 32 * c;
          if (d < D) part += q[t][c] * k_sh[j][d];
        }
        const float s = warp_sum(part);
        const float m_new = fmaxf(m[t], s);
        const float alpha = __expf(m[t] - m_new);
        const float w = __expf(s - m_new);
        l[t] = l[t] * alpha + w;
        m[t] = m_new;
#pragma unroll
        for (int c = 0; c < kMaxDpl; ++c) {
          const int d = lane + 32 * c;
          acc[t][c] = acc[t][c] * alpha + (d < D ? w * v_sh[j][d] : 0.f);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kQpw; ++t) {
    if (pos[t] < 0) continue;
    const int64_t i = i_block + warp * kQpw + t;
    T* o = static_cast<T*>(p.out) + ((p.qo_start[b] + i) * p.Hq + hq) * D;
#pragma unroll
    for (int c = 0; c < kMaxDpl; ++c) {
      const int d = lane + 32 * c;
      if (d < D) o[d] = static_cast<T>(acc[t][c] / l[t]);
    }
  }
}

Params make_params(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const at::Tensor& page_table, double scale, int64_t window, at::Tensor& out) {
  TORCH_CHECK(q.size(2) <= 32 * kMaxDpl, "head_dim ", q.size(2), " > ", 32 * kMaxDpl,
              " is not supported by the CUDA kernels");
  Params p{};
  p.q = q.data_ptr();
  p.q_s0 = q.stride(0);
  p.q_s1 = q.stride(1);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.k_s0 = k_cache.stride(0);
  p.k_s1 = k_cache.stride(1);
  p.v_s0 = v_cache.stride(0);
  p.v_s1 = v_cache.stride(1);
  p.pt = page_table.data_ptr();
  p.pt64 = page_table.scalar_type() == at::kLong;
  p.pt_s0 = page_table.stride(0);
  p.pt_s1 = page_table.stride(1);
  p.Hq = static_cast<int>(q.size(1));
  p.Hkv = static_cast<int>(k_cache.size(1));
  p.G = p.Hq / p.Hkv;
  p.D = static_cast<int>(q.size(2));
  p.window = static_cast<int>(window);
  p.scale = static_cast<float>(scale);
  p.out = out.data_ptr();
  return p;
}

}  // namespace
}  // namespace cuda

at::Tensor decode_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& page_table, const at::Tensor& table_idx,
                                 const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  auto q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t B = q.size(0);
  auto out = at::empty({B, q.size(1), q.size(2)}, q.options());
  if (B == 0) return out;
  auto rows = table_idx.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  auto p = cuda::make_params(q, k_cache, v_cache, page_table, scale, sliding_window, out);
  p.table_idx = rows.data_ptr<int64_t>();
  p.seq_lens = lens.data_ptr<int64_t>();
  const size_t smem = sizeof(float) * (p.G * p.D * (1 + cuda::kWarps) + 2 * cuda::kWarps * p.G);
  const dim3 grid(static_cast<unsigned>(B), static_cast<unsigned>(p.Hkv));
  auto stream = cuda::current_stream();
  MINISGL_DISPATCH_FLOAT(q.scalar_type(), "decode_attention_cuda", [&] {
    if (smem > 48 * 1024)
      cudaFuncSetAttribute(cuda::decode_kernel<scalar_t>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
    cuda::decode_kernel<scalar_t><<<grid, cuda::kThreads, smem, stream>>>(p);
  });
  cuda::check_launch("decode_kernel");
  return out;
}

at::Tensor extend_attention_cuda(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& page_table, const at::Tensor& table_idx,
                                 const at::Tensor& seq_lens, const at::Tensor& extend_lens, double scale,
                                 int64_t sliding_window) {
  auto q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t N = q.size(0), B = table_idx.size(0);
  auto out = at::empty({N, q.size(1), q.size(2)}, q.options());
  if (N == 0 || B == 0) return out;
  auto rows = table_idx.to(at::kLong).contiguous(), lens = seq_lens.to(at::kLong).contiguous();
  auto exts = extend_lens.to(at::kLong).contiguous();
  auto qo_start = at::cumsum(exts, 0).sub_(exts);  // exclusive prefix sum: first q row per request
  const int64_t max_ext = exts.max().item<int64_t>();  // one sync: sizes the grid
  auto p = cuda::make_params(q, k_cache, v_cache, page_table, scale, sliding_window, out);
  p.table_idx = rows.data_ptr<int64_t>();
  p.seq_lens = lens.data_ptr<int64_t>();
  p.extend_lens = exts.data_ptr<int64_t>();
  p.qo_start = qo_start.data_ptr<int64_t>();
  const dim3 grid(static_cast<unsigned>((max_ext + cuda::kQueries - 1) / cuda::kQueries), static_cast<unsigned>(B),
                  static_cast<unsigned>(p.Hq));
  auto stream = cuda::current_stream();
  MINISGL_DISPATCH_FLOAT(q.scalar_type(), "extend_attention_cuda", [&] {
    cuda::extend_kernel<scalar_t><<<grid, cuda::kThreads, 0, stream>>>(p);
  });
  cuda::check_launch("extend_kernel");
  return out;
}

}  // namespace minisgl
