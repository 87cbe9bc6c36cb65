// decode.cpp -- all decoder layers of a small bf16 decode step in one call, in one parallel region (CPU).
//
// The loop of `CausalLM._decode_layers` (nbs/05_models.ipynb), op for op, with two differences:
//   - it runs in C++: from Python, a step of the default model is 240 kernel calls whose interpreter, pybind
//     argument conversion and module lookups cost ~1 ms of a ~10 ms step; here the GIL is also released for
//     the whole step (bindings.cpp), so the overlap scheduler's Python thread runs meanwhile;
//   - the whole step is ONE OpenMP region. Run as separate calls, each of the 120 GEMVs opens its own region,
//     and under OMP_WAIT_POLICY=PASSIVE every region wakes the pool's sleeping threads (~40-60 us measured,
//     as long as a small GEMV). Here the threads stay in the region: every thread streams its part of each
//     GEMV (gemv.h), thread 0 alone runs the small serial kernels between them (norms, rotary + K/V store,
//     attention, SiLU), and a spin barrier separates the phases. No extra threads: whatever OpenMP's wait
//     policy, nothing else competes for the cores.
//
// weights: 10 per layer, in this order (None where a layer has no bias):
//   input_layernorm.weight, qkv_proj.weight, qkv_proj.bias, o_proj.weight, o_proj.bias,
//   post_attention_layernorm.weight, gate_up_proj.weight, gate_up_proj.bias, down_proj.weight, down_proj.bias
// Returns (x, residual) after the last layer, as the Python loop does; given the final norm's weight and the LM
// head's, the step goes on to the logits and returns (logits, residual): fp32 [rows, vocab] holding the bf16
// values `lm_head(norm(x, residual)).float()` would give, written by the GEMV in one pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <atomic>
#include <exception>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MINISGL_RELAX() _mm_pause()
#else
#define MINISGL_RELAX() std::this_thread::yield()
#endif

#include "../common.h"
#include "../ops.h"
#include "attention_plan.h"
#include "gemv.h"

namespace minisgl {
namespace {

// A barrier for the n threads of one region, spinning (a phase lasts microseconds; sleeping would cost a
// wake-up per phase). A waiter that spins long yields its core, in case the thread it waits for lost it.
class SpinBarrier {
 public:
  void wait(int n) {
    const uint32_t gen = gen_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      gen_.store(gen + 1, std::memory_order_release);
      return;
    }
    for (uint32_t spins = 1; gen_.load(std::memory_order_acquire) == gen; ++spins) {
      MINISGL_RELAX();
      if (spins % 4096 == 0) std::this_thread::yield();
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> gen_{0};
};

constexpr size_t kPerLayer = 10;

}  // namespace

std::tuple<at::Tensor, at::Tensor> decode_layers_cpu(
    const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights, double eps,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& out_loc, const at::Tensor& page_table,
    const at::Tensor& table_idx, const at::Tensor& seq_lens, int64_t num_q_heads, int64_t num_kv_heads,
    double scale, const std::vector<int64_t>& sliding_windows, const c10::optional<at::Tensor>& final_norm,
    const c10::optional<at::Tensor>& lm_head) {
  using namespace cpu;
  const char* fn = "decode_layers";
  const size_t L = k_caches.size();
  TORCH_CHECK(L >= 1, fn, ": no layers");
  TORCH_CHECK(weights.size() == kPerLayer * L, fn, ": expected ", kPerLayer, " weights per layer for ", L,
              " layers, got ", weights.size());
  TORCH_CHECK(v_caches.size() == L && sliding_windows.size() == L, fn,
              ": k_caches, v_caches and sliding_windows must have one entry per layer");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(), fn,
              ": x must be a bfloat16 CPU tensor [rows, hidden], got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t n = x_in.size(0), H = x_in.size(1), Hq = num_q_heads, Hkv = num_kv_heads;
  const int64_t D = k_caches[0].size(2);
  TORCH_CHECK(n >= 1 && n <= kGemvMaxM, fn, ": between 1 and ", kGemvMaxM, " rows, got ", n);

  // Everything that can fail is checked here, before the region (an exception must not cross it).
  auto weight = [&](size_t l, size_t i, int64_t rows, int64_t cols) -> const at::Tensor& {
    const auto& w = weights[l * kPerLayer + i];
    TORCH_CHECK(w.has_value() && w->defined(), fn, ": weight ", i, " of layer ", l, " is missing");
    const bool vec = cols == 0;
    TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == at::kBFloat16 && w->is_contiguous() &&
                    (vec ? w->dim() == 1 && w->size(0) == rows : w->dim() == 2 && w->size(0) == rows && w->size(1) == cols),
                fn, ": weight ", i, " of layer ", l, " must be a contiguous bfloat16 CPU tensor of shape [", rows,
                vec ? "" : ", ", vec ? "" : std::to_string(cols), "], got ", w->sizes(), " ", w->scalar_type());
    return *w;
  };
  std::vector<at::Tensor> biases;  // fp32 copies, alive until the end of the step
  auto bias = [&](size_t l, size_t i, int64_t rows) -> const float* {
    const auto& b = weights[l * kPerLayer + i];
    if (!b.has_value() || !b->defined()) return nullptr;
    TORCH_CHECK(b->device().is_cpu() && b->dim() == 1 && b->size(0) == rows, fn, ": bias ", i, " of layer ", l,
                " must be a CPU tensor of shape [", rows, "], got ", b->sizes());
    biases.push_back(b->to(at::kFloat).contiguous());
    return biases.back().data_ptr<float>();
  };
  const int64_t QKV = (Hq + 2 * Hkv) * D;
  const int64_t I2 = weights[6].has_value() && weights[6]->defined() ? weights[6]->size(0) : 0;
  TORCH_CHECK(I2 > 0 && I2 % 2 == 0, fn, ": gate_up_proj must have an even, non-zero number of rows");
  const int nt = static_cast<int>(std::max(1, at::get_num_threads()));
  struct Layer {
    const at::Tensor *ln1, *ln2;
    GemvPlan qkv, o, gate_up, down;
  };
  std::vector<Layer> layers(L);
  biases.reserve(4 * L);
  for (size_t l = 0; l < L; ++l) {
    Layer& ly = layers[l];
    ly.ln1 = &weight(l, 0, H, 0);
    ly.ln2 = &weight(l, 5, H, 0);
    ly.qkv = make_gemv_plan(weight(l, 1, QKV, H), bias(l, 2, QKV), n, true, nt, "");
    ly.o = make_gemv_plan(weight(l, 3, H, Hq * D), bias(l, 4, H), n, true, nt, "");
    ly.gate_up = make_gemv_plan(weight(l, 6, I2, H), bias(l, 7, I2), n, true, nt, "");
    ly.down = make_gemv_plan(weight(l, 8, H, I2 / 2), bias(l, 9, H), n, true, nt, "");
    TORCH_CHECK(k_caches[l].dim() == 3 && k_caches[l].size(1) == Hkv && k_caches[l].size(2) == D, fn,
                ": k_caches[", l, "] must be [slots, ", Hkv, ", ", D, "], got ", k_caches[l].sizes());
  }
  const auto pos = positions.to(at::kLong).contiguous(), loc = out_loc.to(at::kLong).contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == n && loc.dim() == 1 && loc.size(0) == n, fn,
              ": positions and out_loc must have one entry per row");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pos.data_ptr<int64_t>()[i], s = loc.data_ptr<int64_t>()[i];
    TORCH_CHECK(p >= 0 && p < cos.size(0), fn, ": position ", p, " outside [0, ", cos.size(0), ")");
    TORCH_CHECK(s >= 0 && s < k_caches[0].size(0), fn, ": out_loc ", s, " outside [0, ", k_caches[0].size(0), ")");
  }
  auto qkv = at::empty({n, QKV}, x_in.options());
  const at::Tensor q = qkv.narrow(1, 0, Hq * D).view({n, Hq, D});
  const auto o3 = at::empty({n, Hq, D}, x_in.options());  // attention out
  // One attention plan per distinct sliding window (all layers share the queries, page table and lengths).
  std::map<int64_t, std::unique_ptr<DecodeAttentionPlan>> attn;
  for (size_t l = 0; l < L; ++l) {
    check_attention(q, k_caches[l], v_caches[l], page_table, table_idx, seq_lens, c10::nullopt, scale,
                    sliding_windows[l]);
    TORCH_CHECK(k_caches[l].sizes() == k_caches[0].sizes() && k_caches[l].scalar_type() == at::kBFloat16, fn,
                ": every layer's caches must be bfloat16 and shaped like layer 0's");
    auto& plan = attn[sliding_windows[l]];
    if (!plan)
      plan.reset(new DecodeAttentionPlan(q, k_caches[l], v_caches[l], page_table, table_idx, seq_lens, scale,
                                         sliding_windows[l], o3, 1));
  }
  const at::Tensor o = o3.view({n, Hq * D});

  // With the final norm and the LM head, the step ends with the logits (as `lm_head(norm(x)).float()`).
  const bool head = final_norm.has_value() && final_norm->defined() && lm_head.has_value() && lm_head->defined();
  TORCH_CHECK(head || !((final_norm.has_value() && final_norm->defined()) || (lm_head.has_value() && lm_head->defined())),
              fn, ": final_norm and lm_head go together");
  GemvPlan head_plan;
  at::Tensor logits;
  if (head) {
    TORCH_CHECK(final_norm->dim() == 1 && final_norm->size(0) == H && final_norm->scalar_type() == at::kBFloat16 &&
                    final_norm->is_contiguous() && final_norm->device().is_cpu(),
                fn, ": final_norm must be a contiguous bfloat16 CPU tensor of shape [", H, "]");
    TORCH_CHECK(lm_head->dim() == 2 && lm_head->size(1) == H && lm_head->scalar_type() == at::kBFloat16 &&
                    lm_head->is_contiguous() && lm_head->device().is_cpu(),
                fn, ": lm_head must be a contiguous bfloat16 CPU tensor of shape [vocab, ", H, "]");
    head_plan = make_gemv_plan(*lm_head, nullptr, n, true, nt, "");
    logits = at::empty({n, lm_head->size(0)}, x_in.options().dtype(at::kFloat));
  }

  at::Tensor residual = x_in;
  at::Tensor x = rms_norm_cpu(x_in, *layers[0].ln1, eps);  // qkv_proj's input; then down_proj's output
  auto xo = at::empty({n, H}, x_in.options());              // o_proj out, then normed: gate_up_proj's input
  auto gu = at::empty({n, I2}, x_in.options());
  at::Tensor h;                                              // silu(gate) * up
  SpinBarrier barrier;
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  std::atomic<int> leaving{0};

#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    // Each thread runs its part of a GEMV; a plan with fewer parts than threads leaves the rest idle.
    auto gemv = [&](const GemvPlan& p, const at::Tensor& in, at::Tensor& out, YFormat yf = YFormat::bf16) {
      for (int64_t part = tid; part < p.parts; part += team)
        run_gemv_part(p, in.data_ptr(), in.stride(0), true, out.data_ptr(), out.stride(0), yf, part);
    };
    // Thread 0 runs f; every thread returns whether the step failed (then all leave the loop together).
    auto serial = [&](auto&& f) {
      if (tid == 0) {
        try {
          f();
        } catch (...) {
          error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }
      barrier.wait(team);
      return failed.load(std::memory_order_relaxed);
    };
    for (size_t l = 0; l < L; ++l) {
      const Layer& ly = layers[l];
      if (l > 0 && serial([&] { fused_add_rms_norm_cpu(x, residual, *ly.ln1, eps); })) break;
      gemv(ly.qkv, x, qkv);
      barrier.wait(team);
      if (serial([&] {
            at::Tensor kc = k_caches[l], vc = v_caches[l];
            rope_store_kv_cpu(qkv, pos, cos, sin, kc, vc, loc, Hq, Hkv);
            attn[sliding_windows[l]]->run(kc, vc, false);
          }))
        break;
      gemv(ly.o, o, xo);
      barrier.wait(team);
      if (serial([&] { fused_add_rms_norm_cpu(xo, residual, *ly.ln2, eps); })) break;
      gemv(ly.gate_up, xo, gu);
      barrier.wait(team);
      if (serial([&] { h = silu_mul_cpu(gu); })) break;
      gemv(ly.down, h, x);
      barrier.wait(team);
    }
    if (head && !failed.load(std::memory_order_relaxed)) {
      if (!serial([&] { fused_add_rms_norm_cpu(x, residual, *final_norm, eps); }))
        gemv(head_plan, x, logits, YFormat::f32_bf16_rounded);
    }
    // Thread 0 reaches the region's closing barrier last: with OMP_WAIT_POLICY=PASSIVE a thread that waits
    // there sleeps, and thread 0 (the caller) should not need waking before it returns.
    if (tid != 0) {
      leaving.fetch_add(1, std::memory_order_release);
    } else {
      while (leaving.load(std::memory_order_acquire) < team - 1) MINISGL_RELAX();
    }
  }
  if (error) std::rethrow_exception(error);
  return {head ? logits : x, residual};
}

}  // namespace minisgl
