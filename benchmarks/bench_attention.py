"""bf16 attention on the CPU: the AVX512-BF16 kernel bodies (bf16 dot products) against the fp32 bodies that
widen every K/V element (what runs with `MINISGL_CPU_ISA=avx512`, or on a CPU without AVX512-BF16), at contexts
256..4096, one layer per call.

    .venv/bin/python benchmarks/bench_attention.py [--shape 9,3,64] [--rounds 2] [--json out.json]

Each variant runs in its own process (the ISA is fixed when the extension loads); the two alternate for
`--rounds` rounds and the medians of all rounds are reported, with the ratio. Cases:
  prefill L     one prompt of L tokens, causal (chunk 1 of a prefill)
  extend 256+L  256 new tokens over a cached context of L (a later chunk of a chunked prefill)
  decode BxL    B requests of context L, one query each (B=1: a long decode split over key chunks)
Figures: ms per call and GFLOP/s (4 * Hq * D multiply-adds x 2 per visible (query, key) pair). Decode runs the
fp32 bodies in both variants (a bf16 decode body measured no faster): its rows show the noise of the machine.

    .venv/bin/python benchmarks/bench_attention.py --bodies [--shape 9,3,64] [--rounds 7] [--json out.json]

`--bodies` times every body that runs on this CPU (`attention_bodies`: AMX, bf16dot, avx512, avx2, baseline), bf16
and fp32 caches, in one process, one call of each body in turn per round (so that a busy moment of the machine
falls on all of them alike), on the engine's own two timing steps (`time_attention_bodies`, chapter engine) and on
prefill 1024, extend 256+2048, decode 1x4096 and 16x1024; it prints each body's median and the body the engine
would keep from those medians (`choose_attention_body`)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONTEXTS = (256, 512, 1024, 2048, 4096)


def cases():
    for L in CONTEXTS:
        yield f"prefill {L}", dict(lens=[L], exts=[L])
    for L in CONTEXTS:
        yield f"extend 256+{L}", dict(lens=[L + 256], exts=[256])
    for L in CONTEXTS:
        yield f"decode 1x{L}", dict(lens=[L], exts=None)
    for L in CONTEXTS:
        yield f"decode 16x{L}", dict(lens=[L] * 16, exts=None)


def measure(shape, reps):
    "Run in the child: {case: (median ms, GFLOP/s)} for the variant this process's ISA picks."
    import torch
    from minisgl.kernels import native, decode_attention, extend_attention
    Hq, Hkv, D = shape
    page, out = 16, {}
    for name, c in cases():
        lens, exts = c["lens"], c["exts"]
        g = torch.Generator().manual_seed(0)
        pages = [(n + page - 1) // page for n in lens]
        k = torch.randn(sum(pages) * page, Hkv, D, generator=g).bfloat16()
        v = torch.randn(sum(pages) * page, Hkv, D, generator=g).bfloat16()
        order = torch.randperm(sum(pages), generator=g)
        table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
        start = 0
        for b, n in enumerate(lens):
            mine = order[start:start + pages[b]]
            start += pages[b]
            table[b, :n] = (mine[:, None] * page + torch.arange(page)).flatten()[:n].int()
        idx, sl = torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
        nq = len(lens) if exts is None else sum(exts)
        q = torch.randn(nq, Hq, D, generator=g).bfloat16()
        if exts is None:
            fn = lambda: decode_attention(q, k, v, table, idx, sl, D ** -0.5, backend="cpu")
            pairs = sum(lens)
        else:
            el = torch.tensor(exts, dtype=torch.int32)
            fn = lambda: extend_attention(q, k, v, table, idx, sl, el, D ** -0.5, backend="cpu")
            pairs = sum(e * (n - e) + e * (e + 1) // 2 for n, e in zip(lens, exts))
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        ms = statistics.median(times) * 1e3
        out[name] = (ms, 4 * Hq * D * pairs / (ms * 1e-3) / 1e9)
    return dict(isa=native().cpu_isa(), results=out)


def body_batches(shape, dtype):
    "The batches `--bodies` times, name -> (kind, batch): the engine's own two timing steps (chapter engine) and four more."
    from minisgl.engine import _timing_batch
    from minisgl.kernels import make_paged_batch
    Hq, Hkv, D = shape
    more = {"prefill 1024": ("extend", [1024], [1024]), "extend 256+2048": ("extend", [2304], [256]),
            "decode 1x4096": ("decode", [4096], None), "decode 16x1024": ("decode", [1024] * 16, None)}
    out = {f"engine {kind}": (kind, _timing_batch(kind, dtype, D, Hq, Hkv)) for kind in ("decode", "extend")}
    for name, (kind, lens, exts) in more.items():
        out[name] = (kind, make_paged_batch(lens, exts, page=16, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype))
    return out


def measure_bodies(shape, rounds):
    "{dtype: {case: {body: median ms}}} and the engine's choice per (dtype, case), every body in turn each round."
    import torch
    from minisgl.engine import choose_attention_body
    from minisgl.kernels import attention_bodies, decode_attention, extend_attention, use_attention_body
    Hq, Hkv, D = shape
    out, kept = {}, {}
    for dt in (torch.bfloat16, torch.float32):
        name = str(dt).removeprefix("torch.")
        out[name], kept[name] = {}, {}
        for case, (kind, batch) in body_batches(shape, dt).items():
            run = decode_attention if kind == "decode" else extend_attention
            bodies = attention_bodies(kind, dt, D, Hq // Hkv)
            times = {b: [] for b in bodies}
            for r in range(rounds + 1):            # round 0 warms up: pages touched, threads awake
                for b in bodies:
                    use_attention_body(kind, dt, D, Hq // Hkv, b)
                    t = time.perf_counter(); run(**batch, backend="cpu"); ms = (time.perf_counter() - t) * 1e3
                    if r: times[b].append(ms)
            use_attention_body(kind, dt, D, Hq // Hkv, None)
            out[name][case] = {b: statistics.median(t) for b, t in times.items()}
            kept[name][case] = choose_attention_body(out[name][case])
    return out, kept


def main_bodies(args, shape):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_workload import machine
    info = machine()
    print(f"cpu: {info['cpu']} ({info['threads']} threads, flags {' '.join(info['flags'])}); shape Hq,Hkv,D = {shape}")
    out, kept = measure_bodies(shape, args.rounds)
    for dt, cases_ in out.items():
        print(f"{dt}: median ms of {args.rounds} rounds (the flags' body first; * the body the engine keeps)")
        for case, ms in cases_.items():
            cells = "  ".join(f"{'*' if b == kept[dt][case] else ' '}{b} {t:.3f}" for b, t in ms.items())
            print(f"  {case:16s} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, shape=shape, rounds=args.rounds, bodies=out, kept=kept), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9,3,64", help="Hq,Hkv,D (default: SmolLM2-135M's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--bodies", action="store_true", help="time every attention body that runs here, in one process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    if args.child:
        print(json.dumps(measure(shape, args.reps)))
        return
    if args.bodies:
        return main_bodies(args, shape)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_workload import machine
    variants = {"bf16 dot": {}, "fp32 (MINISGL_CPU_ISA=avx512)": {"MINISGL_CPU_ISA": "avx512"}}
    runs = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, env in variants.items():
            cmd = [sys.executable, __file__, "--child", "--shape", args.shape, "--reps", str(args.reps)]
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    isas = {name: r[0]["isa"] for name, r in runs.items()}
    if isas["bf16 dot"] != "avx512bf16":
        print(f"this CPU has no AVX512-BF16 (kernels use {isas['bf16 dot']}): both variants run the fp32 bodies")
    info = machine()
    print(f"cpu: {info['cpu']} ({info['threads']} threads, flags {' '.join(info['flags'])}); shape Hq,Hkv,D = {shape}")
    print(f"{'case':18s} {'bf16 ms':>9s} {'GFLOP/s':>8s} {'fp32 ms':>9s} {'GFLOP/s':>8s} {'speed-up':>8s}")
    table = {}
    for name, _ in cases():
        (a_ms, a_gf), (b_ms, b_gf) = ([statistics.median(r["results"][name][i] for r in runs[v]) for i in (0, 1)]
                                      for v in variants)
        table[name] = dict(bf16_ms=a_ms, bf16_gflops=a_gf, fp32_ms=b_ms, fp32_gflops=b_gf, speedup=b_ms / a_ms)
        print(f"{name:18s} {a_ms:9.3f} {a_gf:8.1f} {b_ms:9.3f} {b_gf:8.1f} {b_ms / a_ms:7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, shape=shape, isas=isas, cases=table), f, indent=1)


if __name__ == "__main__":
    main()
