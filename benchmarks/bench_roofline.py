"""How close minisgl runs to this CPU's limits, each limit measured here: the peak rate of the multiply-add
instructions the matmuls use, and the memory's read bandwidth; against them, what the default model's matmuls
reach in a prefill and what a single-request decode step reaches.

- peaks: a small C++ probe, compiled at run time (torch's cpp_extension) and run in a child process, times
  twelve independent chains of one instruction on registers in every thread, reading no memory:
  `vdpbf16ps` (AVX512-BF16: 32 bf16 products a lane pair), `vfmadd231ps` on zmm (AVX-512) and on ymm (AVX2) in
  fp32, and `tdpbf16ps` (AMX: 16 x 16 x 32 products a tile) where Linux lends the tile state;
- memory: torch's sum over a bf16 buffer of 32 MB, of the model's 270 MB, and of 1 GB (medians of passes);
- prefill: the model's 120 layer matmuls at `--rows` rows (a 265-token prompt), each shape with the kernel
  minisgl's plan picks for that many rows, weights cold (120 distinct weights, as bench_linear.py): GFLOP/s;
- decode: `LLM()` generating 1 + 128 tokens minus 1 token for a 4-token prompt (as bench_latency.py): tok/s,
  and the weights' bytes read per second (every linear weight once per token, the embedding row aside).

It prints each achieved time against the two bounds of a roofline: the multiply-adds at the peak of the
instruction each picked kernel runs (AMX for `amx`, and for oneDNN where it may use AMX; `vdpbf16ps` for the
tiles' default body on AVX512-BF16; fp32 FMA for `fma` and the widening bodies), and the weights' bytes at the
read bandwidth of a 270 MB buffer. JSON (`--out`) holds the machine record of the other scripts; on a CPU with
AMX it runs again capped below AMX, as they do.

    .venv/bin/python benchmarks/bench_roofline.py --out roofline.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_workload import banner, machine, run_capped   # noqa: E402  (the same machine record and AMX re-run)

PROBE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <chrono>
#include <cmath>

volatile float sink;   // the chains' sums end here, so that the compiler keeps them

// Seconds the slowest thread took to run body(iters); every thread runs it once.
template <typename Body>
double timed(int64_t iters, Body body) {
  double worst = 0.0;
#pragma omp parallel reduction(max : worst)
  {
    const auto t0 = std::chrono::steady_clock::now();
    const float s = body(iters);
    worst = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink = s;
  }
  return worst;
}

#define CHAINS 12
#define KEEP(v) __asm__ __volatile__("" : "+v"(v))   // a value the compiler may not fold (an empty asm in the loop slowed it)

__attribute__((target("avx512f,avx512bf16"))) float dpbf16_body(int64_t iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
  __m512bh a = (__m512bh)_mm512_set1_epi16(0x3c00), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  KEEP(a); KEEP(b);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  float s = 0.f;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx512f"))) float fma512_body(int64_t iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
  __m512 a = _mm512_set1_ps(1e-3f), b = _mm512_set1_ps(1e-3f);
  KEEP(a); KEEP(b);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
  }
  float s = 0.f;
  for (int i = 0; i < CHAINS; ++i) s += _mm512_reduce_add_ps(acc[i]);
  return s;
}

__attribute__((target("avx2,fma"))) float fma256_body(int64_t iters) {
  __m256 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_ps();
  __m256 a = _mm256_set1_ps(1e-3f), b = _mm256_set1_ps(1e-3f);
  KEEP(a); KEEP(b);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
  }
  float s = 0.f;
  for (int i = 0; i < CHAINS; ++i) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(acc[i]), _mm256_extractf128_ps(acc[i], 1));
    q = _mm_hadd_ps(q, q); q = _mm_hadd_ps(q, q); s += _mm_cvtss_f32(q);
  }
  return s;
}

struct alignas(64) TileConfig { uint8_t palette = 1, start_row = 0; uint8_t reserved[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };

__attribute__((target("amx-tile,amx-bf16"))) float amx_body(int64_t iters) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  __asm__ __volatile__("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t buf[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) buf[i] = 0x3c00;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (int64_t it = 0; it < iters; ++it) {   // four independent sums, as a 2 x 2 block of a matmul keeps
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

// GFLOP/s of all threads together: flops per iteration per thread, the best of `reps` timings.
template <typename Body>
double rate(Body body, double flops_per_iter, int64_t iters, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) best = std::min(best, timed(iters, body));
  return flops_per_iter * iters * omp_get_max_threads() / best / 1e9;
}

double peak(const std::string& kind, int64_t iters, int reps) {
  if (kind == "dpbf16") return rate(dpbf16_body, CHAINS * 16 * 2 * 2.0, iters, reps);
  if (kind == "fma512") return rate(fma512_body, CHAINS * 16 * 2.0, iters, reps);
  if (kind == "fma256") return rate(fma256_body, CHAINS * 8 * 2.0, iters, reps);
  if (kind == "amx") {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return NAN;   // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return rate(amx_body, 4 * 16 * 16 * 32 * 2.0, iters / 16, reps);
  }
  TORCH_CHECK(false, "unknown kind ", kind);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("peak", &peak); }
"""


def peaks(flags: list[str]) -> dict:
    "GFLOP/s of each multiply-add instruction this CPU has (all threads), measured by the probe in this process."
    import tempfile
    from torch.utils.cpp_extension import load_inline
    with tempfile.TemporaryDirectory(prefix="minisgl-roofline-") as d:
        mod = load_inline("minisgl_roofline_probe", cpp_sources=[PROBE], extra_cflags=["-O3", "-fopenmp"],
                          extra_ldflags=["-fopenmp"], build_directory=d, verbose=False)
        has = set(flags)
        kinds = {"fma256": {"avx2", "fma"}, "fma512": {"avx512f"}, "dpbf16": {"avx512_bf16"},
                 "amx": {"amx_tile", "amx_bf16"}}
        return {k: mod.peak(k, 2_000_000, 5) for k, need in kinds.items() if need <= has}


def cpu_flags() -> list[str]:
    for line in open("/proc/cpuinfo"):
        k, _, v = line.partition(":")
        if k.strip() == "flags": return v.split()
    return []


def bandwidth(mb: int, reps: int = 9) -> float:
    "GB/s of torch's sum over an `mb` MB bf16 buffer (read once per pass; the median pass)."
    import torch
    buf = torch.ones(mb << 19, dtype=torch.bfloat16)
    buf.sum()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); buf.sum(); ts.append(time.perf_counter() - t)
    return buf.nbytes / statistics.median(ts) / 1e9


def prefill_matmuls(rows: int, reps: int) -> dict:
    "The model's 120 layer matmuls at `rows` rows with the plan's picks, weights cold: seconds, GFLOP/s, kernels."
    import torch
    from minisgl.engine import model_linear_specs
    from minisgl.linear import LAYOUT, kernel_plan, pack_weight, run_linear
    specs = model_linear_specs()
    plan = kernel_plan(specs)
    layer = [s for s in specs if s[0] != max(n for n, _ in specs)]    # the LM head sees one row per request
    count = {s: specs[s].count for s in layer}
    pick = {s: next((k for m, k in plan.choices[s] if m >= rows), plan.choices[s][-1][1]) for s in layer}
    torch.manual_seed(0)
    ws = [(s, pack_weight(LAYOUT[pick[s]], torch.randn(*s).bfloat16())) for s in layer for _ in range(count[s])]
    xs = {k: torch.randn(rows, k).bfloat16() for k in {s[1] for s in layer}}
    def once():
        for (n, k), w in ws: run_linear(pick[n, k], xs[k], w, n)
    once()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); once(); ts.append(time.perf_counter() - t)
    flops = {f"{n}x{k}": 2 * rows * n * k * count[n, k] for n, k in layer}
    s, total = statistics.median(ts), sum(flops.values())
    return dict(rows=rows, seconds=s, flops=total, gflops=total / s / 1e9, weight_bytes=total // rows,
                flops_by_shape=flops, kernels={f"{n}x{k}": pick[n, k] for n, k in layer},
                one_row={f"{n}x{k}": (plan.choices[n, k][0][1], 2 * n * k * specs[n, k].count) for n, k in specs})


def peak_of(kernel: str, info: dict, peak: dict) -> str:
    "Which probe's peak bounds `kernel` here: the instruction its inner loop runs."
    amx = "amx" in peak and not info["caps"]["ONEDNN_MAX_CPU_ISA"] and not info["caps"]["MINISGL_CPU_ISA"]
    if kernel == "amx": return "amx"
    if kernel == "fma": return "fma512"
    if kernel == "gemv": return "dpbf16" if "dpbf16" in peak and info["tiles"] == "avx512bf16" else (
        "fma512" if "fma512" in peak else "fma256")
    if kernel == "tiles": return {"avx512bf16": "dpbf16", "avx512": "fma512"}.get(info["tiles"], "fma256")
    if amx: return "amx"                                    # oneDNN (and torch through it) run AMX where they may
    return "dpbf16" if "dpbf16" in peak else "fma512" if "fma512" in peak else "fma256"


def decode(new: int, reps: int) -> dict:
    "Single-request decode: tok/s, and the GB/s of linear weights read (each once per token)."
    import random
    from minisgl.core import SamplingParams
    from minisgl.engine import model_linear_specs
    from minisgl.llm import LLM
    llm = LLM()
    rng = random.Random(0)
    def run(n):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        p = [rng.randrange(100, llm.engine.vocab_size) for _ in range(4)]
        t = time.perf_counter(); llm.generate([p], sp, use_tqdm=False); return time.perf_counter() - t
    run(8)
    rates = [new / (run(1 + new) - run(1)) for _ in range(reps)]
    weight_bytes = 2 * sum(n * k * sp.count for (n, k), sp in model_linear_specs().items())
    tok_s = statistics.median(rates)
    return dict(tok_s=tok_s, weight_mb=weight_bytes / 1e6, gb_s=weight_bytes * tok_s / 1e9)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=265, help="prefill rows (prompt tokens) of the matmul pass")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, metavar="FILE.json")
    ap.add_argument("--no-cap-run", action="store_true", help="on an AMX CPU, skip the run capped below AMX")
    ap.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)   # the child process
    args = ap.parse_args()
    if args.peaks_only:
        print(json.dumps(peaks(cpu_flags()))); return

    info = machine()
    print(banner(info), flush=True)
    # the probe loads its own tile configuration: in a child, so that it never meets minisgl's AMX threads
    r = subprocess.run([sys.executable, __file__, "--peaks-only"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0: raise SystemExit(f"the peak probe failed: {r.stderr[-2000:]}")
    peak = json.loads(r.stdout.strip().splitlines()[-1])
    mem = {f"{mb} MB": bandwidth(mb) for mb in (32, 270, 1024)}
    pre = prefill_matmuls(args.rows, args.reps)
    dec = decode(args.new_tokens, args.reps)

    kernels = set(pre["kernels"].values())
    limits = sorted({peak_of(k, info, peak) for k in kernels})
    one_row = {peak_of(k, info, peak) for k, _ in pre["one_row"].values()}   # the decode step's kernels
    print(f"\npeak multiply-add rates (all {info['threads']} threads): " +
          ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak.items()))
    print("memory read bandwidth: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in mem.items()))
    # each achieved time against the two bounds of a roofline: its multiply-adds at the peak rate, its bytes at the
    # read bandwidth of a buffer as large as the weights (at least one of the two is always paid)
    bw = mem["270 MB"]
    rows_out = [
        (f"{args.rows}-row prefill: the 120 layer matmuls ({', '.join(sorted(kernels))}; {', '.join(limits)})",
         pre["seconds"], sum(f / peak[peak_of(pre["kernels"][s], info, peak)] for s, f in pre["flops_by_shape"].items()) / 1e9,
         pre["weight_bytes"] / bw / 1e9),
        (f"single-request decode: one token ({dec['weight_mb']:.0f} MB of weights; {', '.join(sorted(one_row))})",
         1 / dec["tok_s"], sum(f / peak[peak_of(k, info, peak)] for k, f in pre["one_row"].values()) / 1e9,
         dec["weight_mb"] / 1e3 / bw),
    ]
    print(f"\n| what | achieved | compute bound | memory bound ({bw:.1f} GB/s) | achieved / larger bound |")
    print("|---|---:|---:|---:|---:|")
    for what, t, tc, tm in rows_out:
        print(f"| {what} | {t * 1e3:.1f} ms | {tc * 1e3:.1f} ms | {tm * 1e3:.1f} ms | {t / max(tc, tm):.2f}x |")
    bounds = {what: dict(achieved_s=t, compute_s=tc, memory_s=tm) for what, t, tc, tm in rows_out}
    summary = dict(machine=info, run=vars(args), peaks_gflops=peak, read_gb_s=mem, prefill=pre, decode=dec,
                   bounds=bounds)
    run_capped(__file__, args, info)
    if args.out:
        with open(args.out, "w") as f: json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
