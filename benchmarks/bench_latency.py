"""One request at a time, minisgl against its peers in one run: the time to the first token of a 265-token prompt
and the speed of single-request decode, the default model (SmolLM2-135M-Instruct), greedy.

- minisgl: `LLM()` with its defaults (bf16 where its bf16 kernels run; the kernel plan measured or read first);
- HF transformers: `generate` on one sequence, in bf16 (`--hf-dtype`);
- llama.cpp: `llama-bench` (`--llama-bench PATH`, built outside the repo with the issue's flags) on the same GGUF
  file, which it runs quantized (Q4_1) while minisgl and HF de-quantize it to bf16: `pp265` (the prompt in one
  batch) and `tg128` (128 tokens decoded one by one), with as many threads as torch uses;
- llama.cpp bf16 (with `--llama-quantize PATH` too): the same on a BF16 copy of that file made by llama.cpp's
  `llama-quantize --allow-requantize` (in a temporary folder): the values minisgl runs, and the same 270 MB read
  per token, so that decode compares kernels rather than bytes.

What is timed, for minisgl and HF alike (wall clock, the public API, a new random-token prompt every time so that no
prefix cache hits):
- first token: `generate` of 1 token for a `--prompt-len`-token prompt; prefill tok/s = prompt tokens / that time;
- decode tok/s = `--new-tokens` / (time to generate 1 + `--new-tokens` tokens - time to generate 1 token), on
  prompts of `--decode-prompt` tokens: the prompt and the first token cancel out.
llama-bench reports its own rates (prompt tokens / prompt time, generated tokens / generation time, sampling excluded);
its first-token time here is `--prompt-len` / its pp rate. Every repeat runs all three, interleaved, and the medians
are reported: the machine is shared and its speed drifts. Writes JSON (`--out`) with the CPU model, flags, cores,
torch version and date; on a CPU with AMX, the run is repeated as a CPU without it (oneDNN capped below AMX, minisgl's AMX kernel off).

    .venv/bin/python benchmarks/bench_latency.py --llama-bench /path/to/llama-bench \
        --llama-quantize /path/to/llama-quantize --out latency.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_workload import banner, machine, run_capped   # noqa: E402  (the same machine record and AMX re-run)


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def minisgl_timer(llm):
    from minisgl.core import SamplingParams
    def once(prompt, new):
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        t = time.perf_counter(); out = llm.generate([prompt], sp, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == new
        return time.perf_counter() - t
    return once


def hf_timer(model_dir, dtype):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    def once(prompt, new):
        ids = torch.tensor([prompt])
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
        assert out.shape[1] - ids.shape[1] == new
        return time.perf_counter() - t
    return once


def llama_bench(path: str, gguf: str, threads: int, prompt: int, new: int) -> dict:
    "One llama-bench run (one repetition of each test): {'pp': tok/s, 'tg': tok/s}."
    r = subprocess.run([path, "-m", gguf, "-t", str(threads), "-p", str(prompt), "-n", str(new), "-r", "1", "-o", "json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0: raise RuntimeError(f"llama-bench failed: {r.stderr.strip()[-500:]}")
    rows = json.loads(r.stdout)
    get = lambda kind: next(x["avg_ts"] for x in rows if (x["n_prompt"] > 0) == (kind == "pp") and
                            (x["n_gen"] > 0) == (kind == "tg"))
    return {"pp": get("pp"), "tg": get("tg")}


def bf16_copy(quantize: str, gguf: str, folder: str) -> str:
    "A BF16 copy of `gguf` in `folder`, made by llama.cpp's `llama-quantize` (which de-quantizes, then stores bf16)."
    out = os.path.join(folder, os.path.basename(gguf).rsplit(".", 2)[0] + ".BF16.gguf")
    r = subprocess.run([quantize, "--allow-requantize", gguf, out, "BF16"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not os.path.exists(out): raise RuntimeError(f"llama-quantize failed: {r.stderr.strip()[-500:]}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=265)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--decode-prompt", type=int, default=4, help="prompt tokens of the decode runs")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--hf-dtype", default="bfloat16")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench, built for this CPU")
    ap.add_argument("--llama-quantize", default=None, metavar="PATH",
                    help="llama.cpp's llama-quantize: also run llama-bench on a BF16 copy of the GGUF")
    ap.add_argument("--out", default=None, metavar="FILE.json")
    ap.add_argument("--no-cap-run", action="store_true", help="on an AMX CPU, skip the run capped below AMX (oneDNN and minisgl)")
    args = ap.parse_args()

    from minisgl.llm import LLM
    from minisgl.weights import default_gguf_path, resolve_model
    info = machine()
    print(banner(info), flush=True)
    llm = LLM()
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    systems = {"minisgl": minisgl_timer(llm)}
    if not args.no_hf: systems["hf"] = hf_timer(resolve_model(None, progress=False), args.hf_dtype)
    for once in systems.values():   # warm-up
        once(random_prompt(rng, args.prompt_len, vocab), 1); once(random_prompt(rng, args.decode_prompt, vocab), 8)
    missing, ggufs = {}, {}
    tmp = tempfile.TemporaryDirectory(prefix="minisgl-bench-")
    if not args.llama_bench: missing["llama.cpp"] = "not run: give --llama-bench (llama.cpp's llama-bench, built for this CPU)"
    else:
        ggufs["llama.cpp"] = str(default_gguf_path())
        if not args.llama_quantize: missing["llama.cpp bf16"] = "not run: give --llama-quantize (llama.cpp's llama-quantize)"
        else:
            try: ggufs["llama.cpp bf16"] = bf16_copy(args.llama_quantize, ggufs["llama.cpp"], tmp.name)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e: missing["llama.cpp bf16"] = str(e)

    first = {k: [] for k in systems}; decode = {k: [] for k in systems}
    llama = {name: {"pp": [], "tg": []} for name in ggufs}
    for rep in range(args.reps):
        for k, once in systems.items():
            first[k].append(once(random_prompt(rng, args.prompt_len, vocab), 1))
            t1 = once(random_prompt(rng, args.decode_prompt, vocab), 1)
            tn = once(random_prompt(rng, args.decode_prompt, vocab), 1 + args.new_tokens)
            decode[k].append(args.new_tokens / (tn - t1))
        for name, gguf in ggufs.items():
            if name in missing: continue
            try:
                r = llama_bench(args.llama_bench, gguf, info["threads"], args.prompt_len, args.new_tokens)
                llama[name]["pp"].append(r["pp"]); llama[name]["tg"].append(r["tg"])
            except (RuntimeError, OSError, subprocess.TimeoutExpired, StopIteration, ValueError) as e:
                missing[name] = str(e)
        print(f"rep {rep + 1}: " + ", ".join(f"{k} first token {first[k][-1] * 1e3:.0f} ms, decode {decode[k][-1]:.1f} tok/s"
                                          for k in systems) +
              "".join(f", {name} pp {r['pp'][-1]:.0f} tok/s, tg {r['tg'][-1]:.1f} tok/s"
                      for name, r in llama.items() if r["pp"] and name not in missing), flush=True)
    tmp.cleanup()

    med = statistics.median
    res = {k: {"first_token_s": med(first[k]), "prefill_tok_s": args.prompt_len / med(first[k]),
               "decode_tok_s": med(decode[k])} for k in systems}
    for name, r in llama.items():
        if r["pp"] and name not in missing:
            res[name] = {"first_token_s": args.prompt_len / med(r["pp"]), "prefill_tok_s": med(r["pp"]),
                         "decode_tok_s": med(r["tg"])}
    ours = res["minisgl"]
    print(f"\none request, medians of {args.reps}: first token of a {args.prompt_len}-token prompt, and decode")
    print("| system | first token | prefill tok/s | decode tok/s | minisgl prefill / it | minisgl decode / it |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, r in res.items():
        print(f"| {k} | {r['first_token_s'] * 1e3:.0f} ms | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} | "
              f"{ours['prefill_tok_s'] / r['prefill_tok_s']:.2f}x | {ours['decode_tok_s'] / r['decode_tok_s']:.2f}x |")
    for k, why in missing.items(): print(f"| {k} | missing: {why} | | | | |")
    summary = dict(machine=info, run=vars(args), results=res, missing=missing,
                   samples=dict(first_token_s=first, decode_tok_s=decode, llama_bench=llama),
                   dtype=str(llm.engine.dtype).removeprefix("torch."))
    run_capped(__file__, args, info)
    if args.out:
        with open(args.out, "w") as f: json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
