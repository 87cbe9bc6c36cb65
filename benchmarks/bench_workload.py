"""A mixed offline workload, minisgl against its peers in one run: 48 requests of random-token prompts of 40-300
tokens, 64 new tokens each, greedy, EOS ignored, the default model (SmolLM2-135M-Instruct).

- minisgl: `LLM()` with its defaults (bf16 where its bf16 kernels run, prefill-first rounds; its kernel plan
  measured or read from the cache first; the GGUF served natively or dequantized, as `quantization='auto'` measured
  here), and the same engine with mixed batches (`minisgl_mixed`); with
  `--variants minisgl,minisgl_mixed,minisgl_fp32,minisgl_gguf,minisgl_none` also `LLM(dtype="float32")`, which is
  what a CPU without the bf16 kernels runs, and the file forced native (`quantization="gguf"`) or dequantized (`"none"`);
- HF transformers: `generate` over static batches (left-padded), the best of batch 16 and batch 48, in the faster of
  bf16 and fp32 on this CPU (torch's bf16 matmul is a generic loop on a CPU without AVX-512, where fp32 is several
  times faster): a probe (8 prompts, 8 new tokens, each dtype) picks it, and the JSON keeps the probe's times;
- llama.cpp through llama-cpp-python on the same GGUF file (Q4_1: llama.cpp runs it quantized, minisgl and HF
  de-quantize it to their dtype), one request after another (its Python API decodes one sequence at a time). It is
  optional: `--llama-python PATH` names a Python that has `llama_cpp` (kept outside the repo, e.g. built with
  the issue's CMAKE_ARGS); without it, llama.cpp is reported as missing, with the reason.

Output tok/s = generated tokens / wall time of the whole workload (load and warm-up excluded). With `--reps N`
each system runs N times, interleaved, and the medians are reported. Writes JSON (`--out`) with the CPU model,
flags, cores, torch version and date. On a CPU with AMX the run is repeated as a CPU without it: oneDNN capped below
AMX (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`) and minisgl's own AMX kernel off (`MINISGL_CPU_ISA=avx512bf16`), a fresh
process with its own kernel plan.

    .venv/bin/python benchmarks/bench_workload.py --llama-python /path/to/venv/bin/python --out workload.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LLAMA_CODE = r"""
import json, sys, time
from llama_cpp import Llama
a = json.loads(sys.stdin.read())
llm = Llama(model_path=a["gguf"], n_ctx=512, n_batch=512, n_threads=a["threads"], verbose=False)
eos = llm.token_eos()
def run(prompts):
    n = 0
    for p in prompts:
        out = llm.create_completion(p, max_tokens=a["new"], temperature=0.0, logit_bias={eos: -1e9})
        n += out["usage"]["completion_tokens"]
    return n
run([[1, 2, 3, 4]])   # warm-up
times = []
for prompts in a["prompts"]:
    t = time.perf_counter(); n = run(prompts); times.append(time.perf_counter() - t)
print(json.dumps({"tokens": n, "times": times}))
"""


def machine() -> dict:
    import torch
    model, flags = platform.processor(), []
    try:
        for line in open("/proc/cpuinfo"):
            k, _, v = line.partition(":")
            if k.strip() == "model name": model = v.strip()
            if k.strip() == "flags":
                flags = sorted(f for f in v.split() if f.startswith(("avx512", "amx")) or f in ("avx2", "fma")); break
    except OSError: pass
    from minisgl import kernels
    ext = kernels.native()
    tiles = ext.linear_packed_isa() if ext is not None and hasattr(ext, "linear_packed_isa") else "none"
    return dict(cpu=model, flags=flags, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                tiles=tiles,
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                caps={k: os.environ.get(k, "") for k in ("ONEDNN_MAX_CPU_ISA", "MINISGL_CPU_ISA")})


def banner(info: dict) -> str:
    "The machine record as one line, printed at the top of a run."
    return f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, caps {info['caps']}; flags: {' '.join(info['flags'])}"


CAPS_BELOW_AMX = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MINISGL_CPU_ISA": "avx512bf16"}   # oneDNN's and ours


def run_capped(script: str, args, info: dict) -> None:
    "On a CPU with AMX (and no cap yet), run `script` again as a CPU without AMX (`CAPS_BELOW_AMX`); its JSON goes to `--out`.capped.json."
    if args.no_cap_run or not any(f.startswith("amx") for f in info["flags"]) or info["caps"]["ONEDNN_MAX_CPU_ISA"]: return
    print(f"\nagain as a CPU without AMX ({' '.join(f'{k}={v}' for k, v in CAPS_BELOW_AMX.items())}):", flush=True)
    cmd = [sys.executable, script, *[x for x in sys.argv[1:] if x != "--no-cap-run"], "--no-cap-run"]
    if args.out: cmd[cmd.index("--out") + 1] = args.out + ".capped.json"
    subprocess.run(cmd, env={**os.environ, **CAPS_BELOW_AMX}, check=True)


def workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_minisgl(llm, prompts, new, policy=None):
    from minisgl.core import SamplingParams
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], sp, use_tqdm=False)   # warm-up
    def once(prompts):
        default = llm.scheduler.config.schedule_policy
        if policy: llm.scheduler.config.schedule_policy = policy
        t = time.perf_counter()
        try: outs = llm.generate(prompts, sp, use_tqdm=False)
        finally: llm.scheduler.config.schedule_policy = default
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - t
    return once


def run_hf(model_dir, new, batch, dtype):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    pad = 0
    def once(prompts):
        n, t0 = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i:i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, pad_token_id=pad)
            n += (out.shape[1] - width) * len(chunk)
        return n, time.perf_counter() - t0
    return once


def hf_probe(model_dir, dtype, prompts) -> float:
    "Seconds for HF to generate 8 tokens for `prompts` in one static batch, in `dtype` (after a warm-up)."
    once = run_hf(model_dir, 8, len(prompts), dtype)
    once(prompts[:2])
    return once(prompts)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--min-prompt", type=int, default=40)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf-batches", default="16,48")
    ap.add_argument("--hf-dtypes", default="bfloat16,float32", help="HF's candidate dtypes; a probe keeps the faster")
    ap.add_argument("--variants", default="minisgl,minisgl_mixed",
                    help="minisgl runs: minisgl (LLM() defaults), minisgl_mixed (mixed batches), minisgl_fp32 (dtype float32), "
                         "minisgl_gguf / minisgl_none (quantization forced)")
    ap.add_argument("--llama-python", default=None, metavar="PATH", help="a Python with llama_cpp installed")
    ap.add_argument("--out", default=None, metavar="FILE.json")
    ap.add_argument("--no-cap-run", action="store_true", help="on an AMX CPU, skip the run capped below AMX (oneDNN and minisgl)")
    args = ap.parse_args()

    from minisgl.llm import LLM
    from minisgl.weights import default_gguf_path, resolve_model
    info = machine()
    print(banner(info), flush=True)
    model_dir = resolve_model(None, progress=False)
    variants = args.variants.split(",")
    unknown = set(variants) - {"minisgl", "minisgl_mixed", "minisgl_fp32", "minisgl_gguf", "minisgl_none"}
    if "minisgl" not in variants or unknown: ap.error(f"--variants must include minisgl; unknown: {sorted(unknown)}")
    t = time.perf_counter()
    llm = LLM()   # defaults; its kernel plan is measured here on a first start, else read
    plan = llm.engine.kernel_plan
    print(f"minisgl loaded in {time.perf_counter() - t:.1f} s ({llm.engine.dtype}, quantization {llm.engine.quantization}), kernel plan: "
          f"{plan.source if plan else None}", flush=True)
    # new prompts for every repeat (the same for every system): a repeat of the same prompts would hit minisgl's prefix cache
    reps = [workload(args.requests, args.min_prompt, args.max_prompt, llm.engine.vocab_size, seed=r) for r in range(args.reps)]
    warm = workload(4, args.min_prompt, args.max_prompt, llm.engine.vocab_size, seed=-1)
    mini_onces = {"minisgl": run_minisgl(llm, warm, args.new_tokens)}
    if "minisgl_mixed" in variants: mini_onces["minisgl_mixed"] = run_minisgl(llm, warm, args.new_tokens, "mixed")
    if "minisgl_fp32" in variants: mini_onces["minisgl_fp32"] = run_minisgl(LLM(dtype="float32"), warm, args.new_tokens)
    for q in ("gguf", "none"):
        if f"minisgl_{q}" in variants: mini_onces[f"minisgl_{q}"] = run_minisgl(LLM(quantization=q), warm, args.new_tokens)
    probe = {d: hf_probe(model_dir, d, warm * 2) for d in args.hf_dtypes.split(",")}
    hf_dtype = min(probe, key=probe.get)
    print("HF probe (8 prompts, 8 new tokens): " + ", ".join(f"{d} {t:.1f} s" for d, t in probe.items()) +
          f"; HF runs in {hf_dtype}", flush=True)
    hf_onces = {f"hf_batch{b}": run_hf(model_dir, args.new_tokens, int(b), hf_dtype) for b in args.hf_batches.split(",")}

    results = {**{k: [] for k in mini_onces}, **{k: [] for k in hf_onces}}
    tokens = {}
    for rep, prompts in enumerate(reps):   # interleaved: a slow moment of the machine hurts every system alike
        for k, once in mini_onces.items():   # each its own prompts (same distribution): no prefix-cache hits
            own = prompts if k == "minisgl" else workload(args.requests, args.min_prompt, args.max_prompt,
                                                          llm.engine.vocab_size, seed=1000 + rep)
            n, t = once(own); results[k].append(t); tokens[k] = n
        for k, once in hf_onces.items():
            n, t = once(prompts); results[k].append(t); tokens[k] = n
        print(f"rep {rep + 1}: " + ", ".join(f"{k} {tokens[k] / v[-1]:.1f} tok/s" for k, v in results.items()), flush=True)

    missing = {}
    if args.llama_python:
        a = dict(gguf=str(default_gguf_path()), threads=info["threads"], new=args.new_tokens, prompts=reps, reps=args.reps)
        r = subprocess.run([args.llama_python, "-c", LLAMA_CODE], input=json.dumps(a), capture_output=True, text=True)
        if r.returncode == 0:
            d = json.loads(r.stdout.strip().splitlines()[-1])
            results["llama.cpp"], tokens["llama.cpp"] = d["times"], d["tokens"]
        else: missing["llama.cpp"] = f"llama-cpp-python failed: {r.stderr.strip()[-500:]}"
    else: missing["llama.cpp"] = "not run: give --llama-python (a Python with llama-cpp-python built for this CPU)"

    tps = {k: tokens[k] / statistics.median(v) for k, v in results.items()}
    hf_best = max(v for k, v in tps.items() if k.startswith("hf_"))
    print(f"\n{args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, {args.new_tokens} new each, "
          f"medians of {args.reps}:")
    print("| system | output tok/s | minisgl / system |\n|---|---:|---:|")
    for k, v in tps.items(): print(f"| {k} | {v:.1f} | {tps['minisgl'] / v:.2f}x |")
    for k, why in missing.items(): print(f"| {k} | missing: {why} | |")
    summary = dict(machine=info, workload=vars(args), tokens_per_s=tps, seconds=results, missing=missing,
                   ratio_vs_hf_best=tps["minisgl"] / hf_best,
                   ratio_vs_llama_cpp=tps["minisgl"] / tps["llama.cpp"] if "llama.cpp" in tps else None,
                   dtype=str(llm.engine.dtype).removeprefix("torch."), quantization=llm.engine.quantization,
                   hf_dtype=hf_dtype, hf_probe_s=probe,
                   kernel_plan=plan.source if plan else None)
    runs = [summary]
    run_capped(__file__, args, info)
    if args.out:
        with open(args.out, "w") as f: json.dump(runs if len(runs) > 1 else summary, f, indent=1)


if __name__ == "__main__":
    main()
