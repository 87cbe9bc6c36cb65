// decode.cpp -- all decoder layers of a bf16 decode step (up to 64 requests) in one call, in one parallel region.
//
// The loop of `CausalLM._decode_layers` (nbs/05_models.ipynb), op for op, with two differences:
//   - it runs in C++: from Python, a step of the default model is 240 kernel calls whose interpreter, pybind
//     argument conversion and module lookups cost ~1 ms of a ~10 ms step; here the GIL is also released for
//     the whole step (bindings.cpp), so the overlap scheduler's Python thread runs meanwhile;
//   - the whole step is ONE OpenMP region. Run as separate calls, each of the 120 matmuls opens its own region,
//     and under OMP_WAIT_POLICY=PASSIVE every region wakes the pool's sleeping threads (~40-60 us measured,
//     as long as a small GEMV). Here the threads stay in the region and a spin barrier separates the phases:
//     each matmul is cut into parts (gemv.h: the GEMV over a plain weight, or the tiles over a packed one) that
//     the threads take first come first served, each part a contiguous range of W streamed front to back. The
//     tiles take four parts per thread, so that a thread slowed by the machine (a shared host, another process)
//     takes fewer of them instead of holding the others at the barrier (one part per thread made a 48-request
//     step ~15% slower, medians of 10 alternating runs on a noisy 2-core Zen 5). The GEMV takes one part per
//     thread: it is bound by memory, and every part starts a new stream that the prefetchers must pick up again
//     (one part made a one-request step ~5% faster than four, medians of 30 alternating runs on the same
//     machine). The small kernels in between split the rows of the batch (norms, rotary + K/V store, SiLU) or
//     the attention plan's tasks (attention_plan.h). The row kernels take raw pointers (rows.h): at::Tensor
//     views and checks of a decode row cost more than the row (a row phase of one request took 1.8-3.8 us, the
//     views and checks most of it; 0.7-3 us now, the quantizing below included), and nothing in the region
//     throws. Every row phase splits the rows alike, so a thread goes on to quantize the rows it has just
//     written for the next matmul in the same phase: 10 barriers a layer where there were 13. No extra threads:
//     whatever OpenMP's wait policy, nothing else competes for the cores.
//
// DecodeStep holds what stays from step to step (the weights, the model's shape, the rows) with every projection's
// plan made and checked once; a run takes x, the caches, cos/sin and the batch's lengths (checked each time) and
// re-plans only if a planned-from tensor moved or was written in place (its data pointer or version changed).
// decode_layers_cpu is one DecodeStep built and run: handed everything every step, pybind's conversion of ~420
// tensors and the same plans cost ~0.1 ms of a one-request step of the embedded model.
//
// weights: 10 per layer, in this order (None where a layer has no bias):
//   input_layernorm.weight, qkv_proj, qkv_proj.bias, o_proj, o_proj.bias,
//   post_attention_layernorm.weight, gate_up_proj, gate_up_proj.bias, down_proj, down_proj.bias
// where each projection is its plain bf16 weight [N, K] or its packed tiles (pack_linear_weight). amx, fma: for
// qkv_proj, o_proj, gate_up_proj, down_proj and the LM head (the same in every layer), whether packed tiles run on
// AMX (gemm_amx.cpp) or on AVX-512 fp32 FMAs rather than on the default body (gemm_bf16.cpp); empty for none.
// Returns (x, residual) after the last layer, as the Python loop does; given the final norm's weight and the LM
// head (plain, or packed with its vocab_size), the step goes on to the logits and returns (logits, residual): fp32 [rows, vocab]
// holding the bf16 values `lm_head(norm(x, residual)).float()` would give, written by the matmul in one pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
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
#include "quant.h"
#include "rows.h"

namespace minisgl {
namespace {

using namespace cpu;

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

// One projection of the step: the GEMV over a plain weight, the tiles over a packed one, or the quantized kernel
// (quant.cpp) over quantized parts, whose activations are quantized first into `act` (one per input width).
struct LinearPlan {
  bool tiles = false, quant = false;
  GemvPlan gemv;
  TilesPlan tp;
  QuantPlan qp;
  QAct* act = nullptr;
  int64_t parts() const { return quant ? qp.nparts : tiles ? tp.parts : gemv.parts; }
  void run(int64_t part, const at::Tensor& x, const at::Tensor& y, YFormat yf) const {
    if (quant) run_quant_part(qp, *act, act->xf.data(), part, y.data_ptr(), y.stride(0), yf);
    else if (tiles) run_tiles_part(tp, x.data_ptr(), x.stride(0), x.size(0), y.data_ptr(), y.stride(0), yf, part);
    else run_gemv_part(gemv, x.data_ptr(), x.stride(0), true, y.data_ptr(), y.stride(0), yf, part);
  }
  // rows [r0, r1) of the bf16 input quantized for the kernel (the portable path: widened to fp32)
  void prepare_rows(const at::Tensor& x, int64_t r0, int64_t r1) const {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    if (qp.amx) act->pack_rows(xb, x.stride(0), r0, r1);
    else if (qp.q8) act->quantize_rows(xb, x.stride(0), r0, r1);
    else
      for (int64_t m = r0; m < r1; ++m)
        for (int64_t k = 0; k < qp.K; ++k)
          act->xf[m * qp.K + k] = __builtin_bit_cast(float, uint32_t(xb[m * x.stride(0) + k]) << 16);
  }
};

constexpr size_t kPerLayer = 10;
constexpr int64_t kMaxRows = 64;
constexpr int64_t kSerialRows = 4;  // up to this many rows, the row-wise kernels run on thread 0 alone
constexpr int64_t kTilesPartsPerThread = 4;  // a packed matmul's parts per thread, taken first come first served
constexpr int64_t kGemvPartsPerThread = 1;   // a GEMV's: one stream per thread

}  // namespace

struct DecodeStep::Impl {
  // What the step was built from, as given (kept: the plans point into its tensors).
  struct Spec {
    int64_t rows = 0, head_dim = 0, num_q_heads = 0, num_kv_heads = 0, vocab_size = -1;
    double eps = 0, scale = 1;
    std::vector<c10::optional<at::Tensor>> weights;
    std::vector<int64_t> windows;
    c10::optional<at::Tensor> final_norm, lm_head;
    std::vector<bool> amx, fma, quant_amx;
    std::vector<std::vector<at::Tensor>> quant_weights;
    std::vector<std::vector<int64_t>> quant_types;
  } spec;
  struct Layer {
    const at::Tensor *ln1, *ln2;
    LinearPlan qkv, o, gate_up, down;
  };
  // The plans (plan()), made from the spec's tensors as they were then: their data pointers and versions (a
  // run whose tensors moved or were written in place, by a `.to()` or a load, plans again).
  std::vector<std::pair<const void*, int64_t>> seen;
  int64_t H = 0, QKV = 0, I2 = 0, V = 0;
  int nt = 1;
  std::vector<at::Tensor> biases;   // fp32 copies
  std::map<int64_t, std::unique_ptr<QAct>> acts;   // one per input width of the quantized projections
  std::vector<Layer> layers;
  bool has_head = false;
  LinearPlan head_plan;
  std::mutex busy;   // the activation buffers above are the step's scratch: one run at a time

  template <typename F>
  void for_each_tensor(F&& f) const {
    for (const auto& w : spec.weights)
      if (w.has_value() && w->defined()) f(*w);
    for (const auto& parts : spec.quant_weights)
      for (const auto& t : parts) f(t);
    for (const auto* w : {&spec.final_norm, &spec.lm_head})
      if (w->has_value() && (*w)->defined()) f(**w);
  }
  // read through the TensorImpl: the checked accessors made this pass over ~400 tensors ~50 us of every step
  static std::pair<const void*, int64_t> state(const at::Tensor& t) {
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const auto* data = static_cast<const char*>(impl->storage().data()) + impl->storage_offset() * impl->itemsize();
    return {data, impl->is_inference() ? 0 : static_cast<int64_t>(impl->version_counter().current_version())};
  }
  bool moved() const {
    size_t i = 0;
    bool same = true;
    for_each_tensor([&](const at::Tensor& t) { same = same && i < seen.size() && seen[i++] == state(t); });
    return !same || i != seen.size();
  }
  void plan();
};

DecodeStep::DecodeStep(int64_t rows, const std::vector<c10::optional<at::Tensor>>& weights, double eps, int64_t head_dim,
                       int64_t num_q_heads, int64_t num_kv_heads, double scale,
                       const std::vector<int64_t>& sliding_windows, const c10::optional<at::Tensor>& final_norm,
                       const c10::optional<at::Tensor>& lm_head, int64_t vocab_size, const std::vector<bool>& amx,
                       const std::vector<bool>& fma, const std::vector<std::vector<at::Tensor>>& quant_weights,
                       const std::vector<std::vector<int64_t>>& quant_types, const std::vector<bool>& quant_amx)
    : impl_(new Impl()) {
  const char* fn = "decode_layers";
  Impl& s = *impl_;
  TORCH_CHECK(amx.empty() || amx.size() == 5, fn, ": amx must be empty or name 5 projections (qkv, o, gate_up, down, "
              "lm_head), got ", amx.size());
  TORCH_CHECK(fma.empty() || fma.size() == 5, fn, ": fma must be empty or name 5 projections (qkv, o, gate_up, down, "
              "lm_head), got ", fma.size());
  const size_t L = sliding_windows.size();
  TORCH_CHECK(L >= 1, fn, ": no layers");
  TORCH_CHECK(weights.size() == kPerLayer * L, fn, ": expected ", kPerLayer, " weights per layer for ", L,
              " layers, got ", weights.size());
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, fn, ": between 1 and ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(head_dim >= 1 && num_q_heads >= 1 && num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0, fn,
              ": head_dim and the heads must be positive, the query heads a multiple of the KV heads");
  for (int64_t w : sliding_windows)
    TORCH_CHECK(w == -1 || w > 0, fn, ": sliding_window must be -1 (off) or positive, got ", w);
  TORCH_CHECK(scale > 0, fn, ": scale must be positive, got ", scale);
  s.spec = {rows, head_dim, num_q_heads, num_kv_heads, vocab_size, eps, scale, weights, sliding_windows, final_norm,
            lm_head, amx, fma, quant_amx, quant_weights, quant_types};
  s.plan();
}

// The plans of every projection, checked (the spec's tensors as they are now).
void DecodeStep::Impl::plan() {
  const char* fn = "decode_layers";
  Impl& s = *this;
  const Spec& sp = spec;
  const auto &amx = sp.amx, &fma = sp.fma, &quant_amx = sp.quant_amx;
  const auto& quant_weights = sp.quant_weights;
  const auto& quant_types = sp.quant_types;
  auto body = [&](int which) { return tiles_body(!amx.empty() && amx[which], !fma.empty() && fma[which]); };
  const size_t L = sp.windows.size();
  s.biases.clear();
  s.acts.clear();
  s.layers.clear();
  s.head_plan = LinearPlan();
  s.seen.clear();
  s.nt = static_cast<int>(std::max(1, at::get_num_threads()));
  const int64_t n = sp.rows, nt = s.nt;
  // the hidden size from the first layer's input norm (checked against every norm below)
  const auto& ln0 = sp.weights[0];
  TORCH_CHECK(ln0.has_value() && ln0->defined() && ln0->dim() == 1, fn,
              ": input_layernorm of layer 0 must be a contiguous bfloat16 CPU tensor [hidden]");
  const int64_t H = s.H = ln0->size(0);

  auto norm_weight = [&](const c10::optional<at::Tensor>& w, const char* what, size_t l) -> const at::Tensor& {
    TORCH_CHECK(w.has_value() && w->defined() && w->device().is_cpu() && w->scalar_type() == at::kBFloat16 &&
                    w->is_contiguous() && w->dim() == 1 && w->size(0) == H,
                fn, ": ", what, " of layer ", l, " must be a contiguous bfloat16 CPU tensor [", H, "]");
    return *w;
  };
  TORCH_CHECK(quant_weights.size() == quant_types.size() && (quant_weights.empty() || quant_weights.size() == 4 * L + 1),
              fn, ": quant_weights and quant_types name every projection (4 per layer, then the LM head), or none");
  TORCH_CHECK(quant_amx.empty() || quant_amx.size() == quant_weights.size(), fn,
              ": quant_amx names every projection of quant_weights, or none");
  auto linear = [&](const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b, int64_t rows_out,
                    int64_t cols, const char* what, size_t l, TilesBody tiles, size_t qi) {
    const float* bp = nullptr;   // the bias as fp32 (kept alive in biases), or null
    if (b.has_value() && b->defined()) {
      TORCH_CHECK(b->device().is_cpu() && b->dim() == 1 && b->size(0) == rows_out, fn, ": bias of ", what,
                  " of layer ", l, " must be a CPU tensor of shape [", rows_out, "], got ", b->sizes());
      s.biases.push_back(b->to(at::kFloat).contiguous());
      bp = s.biases.back().data_ptr<float>();
    }
    const bool quantized = !sp.quant_weights.empty() && !sp.quant_weights[qi].empty();
    if (quantized || !(w.has_value() && w->defined())) {
      TORCH_CHECK(quantized, fn, ": ", what, " of layer ", l, " is missing");
      LinearPlan p;
      p.quant = true;
      p.qp = make_quant_plan(sp.quant_weights[qi], quant_types[qi], cols, bp, nt * kTilesPartsPerThread);
      p.qp.amx = !quant_amx.empty() && quant_amx[qi];
      TORCH_CHECK(!p.qp.amx || quant_amx_here(), fn, ": ", what, " runs on AMX, which does not run here");
      TORCH_CHECK(p.qp.N == rows_out, fn, ": quantized ", what, " of layer ", l, " has ", p.qp.N, " rows, expected ",
                  rows_out);
      auto& act = s.acts[cols];
      if (!act) {
        act.reset(new QAct());
        act->reset(n, cols);
        if (!p.qp.q8) act->xf.resize(n * cols);
      }
      if (p.qp.amx && act->xpad.empty()) act->reset_packed(n, cols);   // only where an AMX projection reads it
      p.act = act.get();
      return p;
    }
    TORCH_CHECK(w->device().is_cpu() && w->scalar_type() == at::kBFloat16 && w->is_contiguous(), fn, ": ", what,
                " of layer ", l, " must be a contiguous bfloat16 CPU tensor, got ", w->scalar_type());
    LinearPlan p;
    if (w->dim() == 4) {  // packed tiles
      TORCH_CHECK(linear_packed_available(), fn, ": packed weights need a CPU with AVX2 and FMA");
      TORCH_CHECK(w->size(0) == (rows_out + 15) / 16 && w->size(1) * 2 == cols && w->size(2) == 16 && w->size(3) == 2,
                  fn, ": packed ", what, " of layer ", l, " must be pack_linear_weight of a [", rows_out, ", ", cols,
                  "] weight, got ", w->sizes());
      p.tiles = true;
      p.tp = make_tiles_plan(*w, rows_out, bp, nt * kTilesPartsPerThread, tiles);
    } else {
      TORCH_CHECK(tiles == TilesBody::standard, fn, ": ", what, " runs on AMX or FMAs, which need its packed weight");
      TORCH_CHECK(w->dim() == 2 && w->size(0) == rows_out && w->size(1) == cols, fn, ": ", what, " of layer ", l,
                  " must have shape [", rows_out, ", ", cols, "], got ", w->sizes());
      p.gemv = make_gemv_plan(*w, bp, n, true, nt * kGemvPartsPerThread, "");
    }
    return p;
  };
  const int64_t Hq = sp.num_q_heads, Hkv = sp.num_kv_heads, D = sp.head_dim;
  const int64_t QKV = s.QKV = (Hq + 2 * Hkv) * D;
  // gate_up's rows (2 x intermediate) from down_proj's columns: plain [H, I] or packed [ceil(H/16), I/2, 16, 2]
  const auto& down0 = sp.weights[8];
  const bool down0_quantized = !quant_weights.empty() && !quant_weights[3].empty();
  TORCH_CHECK(down0_quantized || (down0.has_value() && down0->defined() && (down0->dim() == 2 || down0->dim() == 4)),
              fn, ": down_proj of layer 0 is missing");
  // a quantized down_proj's columns: from gate_up's rows (its parts' rows, or its plain/packed weight)
  auto rows_of_gate_up = [&]() -> int64_t {
    if (!quant_weights.empty() && !quant_weights[2].empty()) {
      int64_t r = 0;
      for (const auto& t : quant_weights[2]) r += t.size(0);
      return r;
    }
    const auto& g = sp.weights[6];
    TORCH_CHECK(g.has_value() && g->defined(), fn, ": gate_up_proj of layer 0 is missing");
    return g->dim() == 2 ? g->size(0) : g->size(0) * 16;
  };
  const int64_t I2 = s.I2 = down0_quantized ? rows_of_gate_up()
                                            : 2 * (down0->dim() == 2 ? down0->size(1) : 2 * down0->size(1));
  TORCH_CHECK(I2 > 0 && I2 % 2 == 0, fn, ": gate_up_proj must have an even, non-zero number of rows");
  s.layers.resize(L);
  s.biases.reserve(4 * L);   // plans point into it: no reallocation
  for (size_t l = 0; l < L; ++l) {
    const size_t w = l * kPerLayer;
    Impl::Layer& ly = s.layers[l];
    ly.ln1 = &norm_weight(sp.weights[w + 0], "input_layernorm", l);
    ly.ln2 = &norm_weight(sp.weights[w + 5], "post_attention_layernorm", l);
    ly.qkv = linear(sp.weights[w + 1], sp.weights[w + 2], QKV, H, "qkv_proj", l, body(0), 4 * l);
    ly.o = linear(sp.weights[w + 3], sp.weights[w + 4], H, Hq * D, "o_proj", l, body(1), 4 * l + 1);
    ly.gate_up = linear(sp.weights[w + 6], sp.weights[w + 7], I2, H, "gate_up_proj", l, body(2), 4 * l + 2);
    ly.down = linear(sp.weights[w + 8], sp.weights[w + 9], H, I2 / 2, "down_proj", l, body(3), 4 * l + 3);
  }
  // With the final norm and the LM head, the step ends with the logits (as `lm_head(norm(x)).float()`).
  const bool has_norm = sp.final_norm.has_value() && sp.final_norm->defined();
  s.has_head = sp.lm_head.has_value() && sp.lm_head->defined();
  TORCH_CHECK(has_norm == s.has_head, fn, ": final_norm and lm_head go together");
  if (s.has_head) {
    norm_weight(sp.final_norm, "final_norm", L);
    s.V = sp.lm_head->dim() == 4 || sp.lm_head->dim() == 1 ? sp.vocab_size : sp.lm_head->size(0);
    TORCH_CHECK(s.V >= 1, fn, ": a packed or quantized lm_head needs vocab_size");
    s.head_plan = linear(sp.lm_head->dim() == 1 ? c10::optional<at::Tensor>() : sp.lm_head, c10::nullopt, s.V, H,
                         "lm_head", L, body(4), 4 * L);
  }
  for_each_tensor([&](const at::Tensor& t) { s.seen.push_back(state(t)); });
}

DecodeStep::~DecodeStep() = default;

int64_t DecodeStep::rows() const { return impl_->spec.rows; }

std::tuple<at::Tensor, at::Tensor> DecodeStep::run(const at::Tensor& x_in, const std::vector<at::Tensor>& k_caches,
                                                   const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
                                                   const at::Tensor& sin, const at::Tensor& positions,
                                                   const at::Tensor& out_loc, const at::Tensor& page_table,
                                                   const at::Tensor& table_idx, const at::Tensor& seq_lens) {
  const char* fn = "decode_layers";
  Impl& s = *impl_;
  std::lock_guard<std::mutex> hold(s.busy);
  if (s.moved()) s.plan();   // a weight was moved or written since: plan again
  const size_t L = s.layers.size();
  const int64_t n = s.spec.rows, H = s.H, Hq = s.spec.num_q_heads, Hkv = s.spec.num_kv_heads, D = s.spec.head_dim,
                I2 = s.I2;
  const int nt = s.nt;
  // Everything that can fail is checked here, before the region (an exception must not cross it, and nothing in it
  // throws); what stays from step to step was checked once, when the step was built.
  TORCH_CHECK(k_caches.size() == L && v_caches.size() == L, fn, ": k_caches and v_caches must have one entry per layer (",
              L, "), got ", k_caches.size(), " and ", v_caches.size());
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(), fn,
              ": x must be a bfloat16 CPU tensor [rows, hidden], got ", x_in.sizes(), " ", x_in.scalar_type());
  TORCH_CHECK(x_in.size(0) == n && x_in.size(1) == H, fn, ": this step was built for ", n, " rows of ", H,
              " features, got x ", x_in.sizes());
  TORCH_CHECK(x_in.stride(1) == 1, fn, ": x must be contiguous in its last dimension");
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  std::vector<KvSlots> kv_slots(L);
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
    TORCH_CHECK(kc.dim() == 3 && kc.size(1) == Hkv && kc.size(2) == D && kc.sizes() == k_caches[0].sizes() &&
                    kc.scalar_type() == at::kBFloat16,
                fn, ": every layer's caches must be bfloat16 [slots, ", Hkv, ", ", D, "] like layer 0's, got ",
                kc.sizes());
    TORCH_CHECK(vc.sizes() == kc.sizes() && vc.scalar_type() == kc.scalar_type() && kc.stride(2) == 1 &&
                    vc.stride(2) == 1 && kc.device().is_cpu() && vc.device().is_cpu(),
                fn, ": layer ", l, "'s caches must be CPU tensors alike, contiguous in head_dim");
    kv_slots[l] = {bits(kc), bits(vc), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1)};
  }
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->dim() == 2 && t->size(1) == D &&
                    t->is_contiguous() && t->size(0) == cos.size(0),
                fn, ": cos and sin must be contiguous bfloat16 CPU tables [max_pos, ", D, "], got ", t->sizes());
  const auto pos = positions.to(at::kLong).contiguous(), loc = out_loc.to(at::kLong).contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == n && loc.dim() == 1 && loc.size(0) == n, fn,
              ": positions and out_loc must have one entry per row");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = pos.data_ptr<int64_t>()[i], sl = loc.data_ptr<int64_t>()[i];
    TORCH_CHECK(p >= 0 && p < cos.size(0), fn, ": position ", p, " outside [0, ", cos.size(0), ")");
    TORCH_CHECK(sl >= 0 && sl < k_caches[0].size(0), fn, ": out_loc ", sl, " outside [0, ", k_caches[0].size(0), ")");
  }
  auto qkv = at::empty({n, s.QKV}, x_in.options());
  const at::Tensor q = qkv.narrow(1, 0, Hq * D).view({n, Hq, D});
  const auto o3 = at::empty({n, Hq, D}, x_in.options());  // attention out
  const at::Tensor o = o3.view({n, Hq * D});
  // One attention plan per distinct sliding window (all layers share the queries, page table and lengths; every
  // layer's caches have layer 0's layout, checked above).
  check_attention(q, k_caches[0], v_caches[0], page_table, table_idx, seq_lens, c10::nullopt, s.spec.scale, -1);
  std::map<int64_t, std::unique_ptr<DecodeAttentionPlan>> attn;
  for (size_t l = 0; l < L; ++l) {
    auto& plan = attn[s.spec.windows[l]];
    if (!plan)
      plan.reset(new DecodeAttentionPlan(q, k_caches[l], v_caches[l], page_table, table_idx, seq_lens, s.spec.scale,
                                         s.spec.windows[l], o3, nt));
  }
  std::vector<DecodeAttentionPlan*> layer_attn(L);
  for (size_t l = 0; l < L; ++l) layer_attn[l] = attn[s.spec.windows[l]].get();
  const bool has_head = s.has_head;
  at::Tensor logits;
  if (has_head) logits = at::empty({n, s.V}, x_in.options().dtype(at::kFloat));
  const auto& layers = s.layers;
  const LinearPlan& head_plan = s.head_plan;

  at::Tensor residual = x_in;
  at::Tensor x = rms_norm_cpu(x_in, *layers[0].ln1, s.spec.eps);  // qkv_proj's input; then down_proj's output
  auto xo = at::empty({n, H}, x_in.options());              // o_proj out, then normed: gate_up_proj's input
  auto gu = at::empty({n, I2}, x_in.options());
  auto h = at::empty({n, I2 / 2}, x_in.options());          // silu(gate) * up

  // The row phases below call rows.h's kernels on raw pointers: at::Tensor views of a row cost more than the row.
  uint16_t *xp = bits(x), *rp = bits(residual), *xop = bits(xo), *gup = bits(gu), *hp = bits(h), *qkvp = bits(qkv);
  const int64_t xs = x.stride(0), rs = residual.stride(0), xos = xo.stride(0), gus = gu.stride(0), hs = h.stride(0),
                qs = qkv.stride(0);
  const int64_t *pp = pos.data_ptr<int64_t>(), *lp = loc.data_ptr<int64_t>();
  const uint16_t *cosp = bits(cos), *sinp = bits(sin);
  const float epsf = static_cast<float>(s.spec.eps);
  SpinBarrier barrier;
  std::atomic<int> leaving{0};
  std::atomic<int64_t> next_task{0};
  std::atomic<int64_t> next_part{0};

#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    int64_t part_base = 0;  // this thread's count of next_part at the start of the current matmul
    // This thread's rows for the row-wise kernels: all on thread 0 for a small batch, else an even split. Every
    // row phase splits alike, so a phase may quantize for the next matmul the rows it has just written.
    const int64_t per = n <= kSerialRows ? n : (n + team - 1) / team;
    const int64_t r0 = n <= kSerialRows ? (tid == 0 ? 0 : n) : std::min<int64_t>(n, tid * per);
    const int64_t rc = std::max<int64_t>(0, std::min<int64_t>(n, r0 + per) - r0);
    std::vector<float> buf(H);  // a norm row's scratch
    // f() on this thread's rows, then, before the next matmul when it is quantized, those rows of its input
    // quantized; then the barrier (one phase and one barrier where the two were separate).
    auto rows_then = [&](auto&& f, const LinearPlan* next, const at::Tensor* in) {
      if (rc > 0) {
        f();
        if (next != nullptr && next->quant) next->prepare_rows(*in, r0, r0 + rc);
      }
      barrier.wait(team);
    };
    auto no_rows = [] {};
    // Runs the parts of a matmul, first come first served, so that a thread the machine slows down takes fewer
    // of them. Every thread's last fetch_add overshoots by one, so the counter ends each matmul at
    // part_base + parts + team, which every thread knows without reading it.
    auto take_parts = [&](const LinearPlan& p, const at::Tensor& in, const at::Tensor& out, YFormat yf) {
      const int64_t end = part_base + p.parts();
      for (int64_t t; (t = next_part.fetch_add(1, std::memory_order_relaxed)) < end;) p.run(t - part_base, in, out, yf);
      part_base = end + team;
    };
    auto matmul = [&](const LinearPlan& p, const at::Tensor& in, const at::Tensor& out) {
      take_parts(p, in, out, YFormat::bf16);
      barrier.wait(team);
    };
    auto attention = [&](DecodeAttentionPlan& plan) {
      take_tasks(next_task, plan.num_tasks(), plan.task_group(), [&](int64_t t) { plan.run_task(t, tid); });
      barrier.wait(team);
      if (plan.num_split_pairs() > 0) {
        for (int64_t i = tid; i < plan.num_split_pairs(); i += team) plan.finish_split(i, tid);
        barrier.wait(team);
      }
    };
    auto add_norm = [&](uint16_t* y, int64_t ys, const at::Tensor& w) {  // y = norm(residual += y), in place
      norm_bf16_rows(y + r0 * ys, ys, rp + r0 * rs, rs, bits(w), y + r0 * ys, ys, rc, H, epsf, buf.data());
    };
    for (size_t l = 0; l < L; ++l) {
      const Impl::Layer& ly = layers[l];
      DecodeAttentionPlan& plan = *layer_attn[l];
      if (l == 0) rows_then(no_rows, &ly.qkv, &x);   // x was normed before the region
      else rows_then([&] { add_norm(xp, xs, *ly.ln1); }, &ly.qkv, &x);
      matmul(ly.qkv, x, qkv);
      if (tid == 0) {  // thread 0 (which holds row 0) readies the attention of this layer
        plan.bind(k_caches[l], v_caches[l]);
        next_task.store(0, std::memory_order_relaxed);
      }
      rows_then([&] { rope_store_kv_bf16_rows(qkvp + r0 * qs, qs, pp + r0, lp + r0, cosp, sinp, kv_slots[l], rc, Hq, Hkv, D); },
                nullptr, nullptr);
      attention(plan);
      if (ly.o.quant) rows_then(no_rows, &ly.o, &o);
      matmul(ly.o, o, xo);
      rows_then([&] { add_norm(xop, xos, *ly.ln2); }, &ly.gate_up, &xo);
      matmul(ly.gate_up, xo, gu);
      rows_then([&] { silu_mul_bf16_rows(gup + r0 * gus, gus, hp + r0 * hs, hs, rc, I2 / 2); }, &ly.down, &h);
      matmul(ly.down, h, x);
    }
    if (has_head) {
      rows_then([&] { add_norm(xp, xs, *s.spec.final_norm); }, &head_plan, &x);
      take_parts(head_plan, x, logits, YFormat::f32_bf16_rounded);
    }
    release_amx();  // where a matmul or the attention ran on AMX
    // Thread 0 reaches the region's closing barrier last: with OMP_WAIT_POLICY=PASSIVE a thread that waits
    // there sleeps, and thread 0 (the caller) should not need waking before it returns.
    if (tid != 0) {
      leaving.fetch_add(1, std::memory_order_release);
    } else {
      while (leaving.load(std::memory_order_acquire) < team - 1) MINISGL_RELAX();
    }
  }
  return {has_head ? logits : x, residual};
}


std::tuple<at::Tensor, at::Tensor> decode_layers_cpu(
    const at::Tensor& x_in, const std::vector<c10::optional<at::Tensor>>& weights, double eps,
    const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches, const at::Tensor& cos,
    const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& out_loc, const at::Tensor& page_table,
    const at::Tensor& table_idx, const at::Tensor& seq_lens, int64_t num_q_heads, int64_t num_kv_heads,
    double scale, const std::vector<int64_t>& sliding_windows, const c10::optional<at::Tensor>& final_norm,
    const c10::optional<at::Tensor>& lm_head, int64_t vocab_size, const std::vector<bool>& amx,
    const std::vector<bool>& fma, const std::vector<std::vector<at::Tensor>>& quant_weights,
    const std::vector<std::vector<int64_t>>& quant_types, const std::vector<bool>& quant_amx) {
  TORCH_CHECK(!k_caches.empty() && k_caches[0].dim() == 3, "decode_layers: k_caches must hold every layer's cache "
              "[slots, kv heads, head_dim]");
  TORCH_CHECK(x_in.dim() == 2, "decode_layers: x must be a bfloat16 CPU tensor [rows, hidden], got ", x_in.sizes());
  DecodeStep step(x_in.size(0), weights, eps, k_caches[0].size(2), num_q_heads, num_kv_heads, scale, sliding_windows,
                  final_norm, lm_head, vocab_size, amx, fma, quant_weights, quant_types, quant_amx);
  return step.run(x_in, k_caches, v_caches, cos, sin, positions, out_loc, page_table, table_idx, seq_lens);
}

}  // namespace minisgl
