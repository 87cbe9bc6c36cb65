"""Quantized weights (chapter quant): decode tok/s of the embedded Q4_1 GGUF served natively (`--quantization gguf`),
dequantized to bf16 (`none`) and as int8 weights (`int8`), against llama.cpp's `llama-bench` on the same file, in one run.

- single-request decode and batches of 8 and 32 requests decoding together: `LLM.generate` of B prompts of
  `--prompt-len` tokens, timed with `max_tokens=1` (prefill + one token) and with `1 + new` tokens; the decode rate
  is B * new / (the difference), medians over `--reps`;
- the weight-read bound of each mode: the bytes of weights one decode step reads (the linears and, for the LM head,
  its table) over the read bandwidth measured here (a torch sum over a buffer of the same size);
- llama.cpp: `llama-bench -n new -p 0` (a single request), if `--llama-bench PATH` is given;
- with `--choice N`, only what `quantization='auto'` measures (chapter engine, `measure_quantization`): decode steps
  of 1, 8 and 32 requests natively and dequantized, N times in turn, with each run's choice and the medians;
- with `--linears`, only the time of every quantized linear of a decode step of B rows on `q8dot` (each called from
  Python, so the weights stream from memory as in a step): the kernels alone, to compare two builds side by side.

    .venv/bin/python benchmarks/bench_quant.py --llama-bench /path/to/llama-bench --out benchmarks/results/quant.json

`--rounds N` alternates single-request decode natively and llama-bench N times (the machine is shared: the ratio
of each round's pair is the figure to trust), then reports the medians and the median ratio. With `--depths 0,1000,2000`
the request decodes after a prompt of exactly that many tokens, and llama-bench with as many in its cache (`-d`): the
attention's share of a step grows with the context.
`--formats` times one row of activations against 128 MB of random weights of each format (copies of a 1536 x 1536
weight, so that they stream from memory): GB/s and weights/s per format, the kernel's rate where the file is not
the point.
`--model FILE.gguf` measures another file than the embedded Q4_1 one (a Q4_K_M file, say), llama.cpp on it too.

Every figure names the CPU it ran on (lscpu's model name and flags) and the caps in force (MINISGL_CPU_ISA,
ONEDNN_MAX_CPU_ISA).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def cpu_info() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    get = lambda key: next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith(key)), "")
    flags = sorted(f for f in get("Flags").split() if f.startswith(("avx", "amx")))
    from minisgl.quant import q8dot_isa
    return {"cpu": get("Model name"), "flags": flags, "threads": torch.get_num_threads(), "q8dot": q8dot_isa() or "portable",
            "caps": {k: os.environ.get(k, "") for k in ("MINISGL_CPU_ISA", "ONEDNN_MAX_CPU_ISA")}}


def read_bandwidth(nbytes: int) -> float:
    buf = torch.ones(nbytes // 4)
    def once():
        t = time.perf_counter(); buf.sum(); return time.perf_counter() - t
    once()
    return nbytes / statistics.median(once() for _ in range(7))


def step_bytes(model) -> int:
    "Bytes of weights one decode step reads: every linear's weight (quantized or dense), the LM head included."
    from minisgl.linear import PackedLinear
    from minisgl.quant import QuantLinear
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear): total += m.nbytes
        elif isinstance(m, (torch.nn.Linear, PackedLinear)):
            w = m.weight if m.weight is not None else getattr(m, "tiles", None)
            total += w.numel() * w.element_size()
    return total


def decode_rates(llm, batches, prompt_len, new, reps, exact_len=False) -> dict:
    "Decode tok/s of B requests together, for each B in `batches`; `exact_len`: prompts of exactly `prompt_len` tokens."
    from minisgl.core import SamplingParams
    words = "the quick brown fox jumps over a lazy dog while it rains on the hills far away".split()
    out = {}
    for b in batches:
        prompts = [" ".join(words[(i + j) % len(words)] for j in range(prompt_len)) for i in range(b)]
        if exact_len: prompts = [llm.tokenizer.encode(p)[:prompt_len] for p in prompts]
        def run(n):
            p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            t = time.perf_counter(); llm.generate(prompts, p); return time.perf_counter() - t
        run(2)
        rates = []
        for _ in range(reps):
            t1, t2 = run(1), run(1 + new)
            rates.append(b * new / max(1e-9, t2 - t1))
        out[b] = statistics.median(rates)
        print(f"  batch {b}: {out[b]:.1f} tok/s", flush=True)
    return out


def linear_times(llm, batches, reps=9) -> dict:
    "Milliseconds a decode step of B rows spends in the model's quantized linears on q8dot, called one by one from Python."
    from minisgl.quant import QuantLinear
    lins = [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]
    out = {}
    for b in batches:
        xs = {k: torch.randn(b, k).to(llm.engine.dtype) for k in {l.in_features for l in lins}}
        def once():
            t = time.perf_counter()
            for l in lins: l.run("q8dot", xs[l.in_features])
            return time.perf_counter() - t
        once()
        out[b] = statistics.median(once() for _ in range(reps)) * 1e3
        print(f"  quantized linears, {b} rows: {out[b]:.2f} ms ({len(lins)} calls)", flush=True)
    return out


def llama_tg(path: str, gguf: str, threads: int, new: int, reps: int, depth: int = 0) -> float:
    r = subprocess.run([path, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(new), "-r", str(reps), "-d", str(depth), "-o", "json"],
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0: raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout)[0]["avg_ts"]


def format_rates(reps: int = 15) -> dict:
    "Per format: GB/s and G weights/s of q8dot for one row of activations over 128 MB of 1536 x 1536 weights (best of `reps`)."
    from minisgl.kernels import native
    from minisgl.quant import QUANT_FORMATS, random_gguf_rows, repack
    n = k = 1536
    out = {}
    for name, fmt in QUANT_FORMATS.items():
        if name == "I8": continue
        w0 = torch.from_numpy(repack(fmt, random_gguf_rows(fmt, n, k), k))
        ws, x = [w0.clone() for _ in range((128 << 20) // w0.numel())], torch.randn(1, k)
        def once():
            t = time.perf_counter()
            for w in ws: native().quant_linear(x, [w], [fmt.qtype], None)
            return time.perf_counter() - t
        once()
        t = min(once() for _ in range(reps))
        out[name] = {"GB_s": sum(w.numel() for w in ws) / t / 1e9, "Gweights_s": n * k * len(ws) / t / 1e9}
        print(f"  {name}: {out[name]['GB_s']:.1f} GB/s, {out[name]['Gweights_s']:.1f} G weights/s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="gguf,none,int8")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None, metavar="FILE.gguf", help="a .gguf file (default: the embedded Q4_1 one)")
    ap.add_argument("--llama-bench", default=None, metavar="PATH")
    ap.add_argument("--out", default=None)
    ap.add_argument("--choice", type=int, default=0, metavar="N", help="only time auto's measurement N times (no generation)")
    ap.add_argument("--rounds", type=int, default=0, metavar="N", help="only alternate single-request decode (gguf) and llama-bench N times")
    ap.add_argument("--depths", default=None, metavar="D,D,...", help="with --rounds: one request after a prompt of D tokens, against llama-bench -d D")
    ap.add_argument("--formats", action="store_true", help="only time q8dot per format over weights streamed from memory")
    ap.add_argument("--linears", action="store_true", help="only time the quantized linears of --quantization gguf, per batch")
    args = ap.parse_args()
    from minisgl import LLM
    from minisgl.weights import default_gguf_path
    info = cpu_info()
    print(json.dumps(info), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    if args.choice:
        from minisgl.engine import EngineConfig, measure_quantization
        runs = []
        for i in range(args.choice):
            c = measure_quantization(EngineConfig(model=args.model))
            runs.append({"native": c.native, "dequantized": c.dequantized, "ratio": c.ratio, "choice": c.quantization})
            print(f"  run {i + 1}: {c}", flush=True)
        med = {k: {m: statistics.median(r[k][m] for r in runs) for m in runs[0][k]} for k in ("native", "dequantized")}
        print("medians, ms a step: " + ", ".join(f"{m} rows {med['native'][m] * 1e3:.1f} natively vs "
                                                f"{med['dequantized'][m] * 1e3:.1f} dequantized" for m in med["native"]), flush=True)
        if args.out:
            from minisgl.engine import _resolve_dtype
            dtype = str(_resolve_dtype("auto", torch.device("cpu")))   # what EngineConfig() ran: the default dtype here
            with open(args.out, "w") as f: json.dump({"info": info, "dtype": dtype, "choice_runs": runs, "medians": med}, f, indent=1)
        return
    if args.formats:
        rates = format_rates()
        if args.out:
            with open(args.out, "w") as f: json.dump({"machine": info, "run": vars(args), "formats": rates}, f, indent=1)
        return
    if args.rounds:
        if not args.llama_bench: ap.error("--rounds needs --llama-bench")
        llm, gguf = LLM(model=args.model, quantization="gguf", max_running_reqs=1), args.model or str(default_gguf_path())
        by_depth = {}
        for d in [int(x) for x in args.depths.split(",")] if args.depths else [None]:
            rounds = []
            for i in range(args.rounds):
                # at a depth: a prompt of exactly that many tokens (one at depth 0), against llama-bench -d (as many in its cache)
                ours = decode_rates(llm, [1], max(d, 1) if d is not None else args.prompt_len, args.new_tokens, args.reps,
                                    exact_len=d is not None)[1]
                theirs = llama_tg(args.llama_bench, gguf, info["threads"], args.new_tokens, args.reps, d or 0)
                rounds.append({"minisgl": ours, "llama.cpp": theirs, "ratio": ours / theirs})
                print(f"  {'' if d is None else f'depth {d}, '}round {i + 1}: minisgl {ours:.1f} tok/s, "
                      f"llama.cpp {theirs:.1f} tok/s, ratio {ours / theirs:.2f}", flush=True)
            med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
            print(f"medians{'' if d is None else f' at depth {d}'}: minisgl {med['minisgl']:.1f} tok/s, "
                  f"llama.cpp {med['llama.cpp']:.1f} tok/s, ratio {med['ratio']:.2f}", flush=True)
            by_depth[d] = {"rounds": rounds, "medians": med}
        if args.out:
            res = by_depth[None] if None in by_depth else {"depths": {str(d): r for d, r in by_depth.items()}}
            with open(args.out, "w") as f:
                json.dump({"machine": info, "run": vars(args), "file": os.path.basename(gguf), **res}, f, indent=1)
        return
    if args.linears:
        llm = LLM(model=args.model, quantization="gguf", max_running_reqs=max(batches))
        linear_times(llm, batches)
        llm.close()
        return
    results, bounds = {}, {}
    for mode in args.modes.split(","):
        print(f"minisgl --quantization {mode}", flush=True)
        llm = LLM(model=args.model, quantization=mode, max_running_reqs=max(batches))
        nbytes = step_bytes(llm.engine.model)
        bounds[mode] = {"step_bytes": nbytes, "bound_tok_s": read_bandwidth(nbytes) / nbytes}
        print(f"  reads {nbytes / 1e6:.0f} MB a step: at most {bounds[mode]['bound_tok_s']:.0f} tok/s for one request", flush=True)
        results[mode] = decode_rates(llm, batches, args.prompt_len, args.new_tokens, args.reps)
        llm.close()
        del llm
    if args.llama_bench:
        results["llama.cpp"] = {1: llama_tg(args.llama_bench, args.model or str(default_gguf_path()), info["threads"], args.new_tokens, args.reps)}
        print(f"llama.cpp (llama-bench, same file): batch 1: {results['llama.cpp'][1]:.1f} tok/s", flush=True)
    print("\n| mode | " + " | ".join(f"batch {b}" for b in batches) + " | weight-read bound (1 request) |")
    print("|---|" + "---:|" * (len(batches) + 1))
    for mode, r in results.items():
        cells = [f"{r[b]:.0f}" if b in r else "" for b in batches]
        bound = f"{bounds[mode]['bound_tok_s']:.0f} ({bounds[mode]['step_bytes'] / 1e6:.0f} MB)" if mode in bounds else ""
        print(f"| {mode} | " + " | ".join(cells) + f" | {bound} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "run": vars(args), "file": os.path.basename(args.model or str(default_gguf_path())),
                       "decode_tok_s": results, "bounds": bounds}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
