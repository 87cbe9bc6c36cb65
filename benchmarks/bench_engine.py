"""minisgl engine vs Hugging Face transformers on this machine, default model (SmolLM2-135M-Instruct).

Reports, per dtype: single-request decode tokens/s, decode tokens/s at batch 8/32/64, prefill tokens/s,
each next to HF `generate` on the same prompts (a static batch of the same size) in the same run, as
medians, with the ratio; plus the memory-bandwidth bound for single-request decode (all weights read
once per token at the measured bandwidth): `--bound-reps` pairs of (bandwidth measured, then a decode run),
reported as medians, and the median of the per-pair ratios (the machine's bandwidth drifts with its load).

    .venv/bin/python benchmarks/bench_engine.py                  # everything (several minutes)
    .venv/bin/python benchmarks/bench_engine.py --dtypes bfloat16 --batches 1,32 --new-tokens 16

Decode tokens/s = batch size / median time of a decode step with the whole batch running (ours: the
engine's `forward_batch`, driven by the real scheduler; HF: the time between consecutive calls of a
logits processor, i.e. one `generate` step). Prefill tokens/s = prompt tokens / prefill time for a
batch of `--prefill-batch` prompts of `--prompt-len` tokens (HF: `generate(max_new_tokens=1)`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP's wait policy is left as a user's process gets it (`minisgl serve` does not set it); --omp-passive sets
# OMP_WAIT_POLICY=PASSIVE (idle pool threads sleep instead of spinning) for both engines. OpenMP reads it when
# torch loads it, so it is decided here, before `import torch`.
if "--omp-passive" in sys.argv: os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.messages import UserMsg
from minisgl.scheduler import Scheduler, SchedulerConfig

TEXT = ("The history of computing is a story of people trying to make machines do arithmetic faster. "
        "Early mechanical calculators used gears and levers; later, relays and vacuum tubes replaced them. "
        "The transistor made computers small and reliable, and the integrated circuit made them cheap. ") * 40


def measure_bandwidth(mb: int = 1024, reps: int = 7) -> float:
    """Read bandwidth in GB/s: the best median time of streaming a buffer much larger than the caches.

    Two read-only reductions (`sum`, `amax`), each with torch's threads (both cores) and with one thread: on a
    shared machine the all-threads run can lose a core to another process and under-measure, which would make
    the bound too easy; the best of the four is what this machine can read."""
    x = torch.ones(mb * (1 << 20) // 4, dtype=torch.float32)
    threads = torch.get_num_threads()
    best = 0.0
    try:
        for n in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(n)
            for f in (torch.sum, torch.amax):
                f(x)
                ts = []
                for _ in range(reps):
                    t = time.perf_counter(); f(x); ts.append(time.perf_counter() - t)
                best = max(best, x.numel() * 4 / statistics.median(ts) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return best


def model_bytes(cfg, itemsize: int) -> int:
    "Bytes of all weights (a tied LM head counted once): what one decode step must read."
    h, i = cfg.hidden_size, cfg.intermediate_size
    layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i + 2 * h
    lm = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return (cfg.vocab_size * h + cfg.num_layers * layer + h + lm) * itemsize


def prompts_of(tok, n: int, length: int) -> list[list[int]]:
    "n distinct prompts of exactly `length` tokens (windows of one long text: no shared prefixes)."
    ids = tok(TEXT)["input_ids"]
    return [ids[7 * i: 7 * i + length] for i in range(n)]


class Timed:
    "Wraps engine.forward_batch to record (phase, batch size, tokens, seconds) per step."
    def __init__(self, engine):
        self.engine, self.orig, self.log = engine, engine.forward_batch, []
        engine.forward_batch = self

    def __call__(self, batch):
        t = time.perf_counter()
        out = self.orig(batch)
        self.log.append((batch.phase, len(batch.reqs), int(batch.input_ids.numel()), time.perf_counter() - t))
        return out


def ours_run(engine, timer, prompts, new_tokens, prefill_budget):
    timer.log.clear()
    sched = Scheduler(engine, SchedulerConfig(max_running_reqs=len(prompts), prefill_budget=prefill_budget,
                                              cache="naive"))
    for i, p in enumerate(prompts):
        sched.submit(UserMsg(i, p, SamplingParams(max_tokens=new_tokens, ignore_eos=True)))
    sched.run_until_idle()
    sched.close() if hasattr(sched, "close") else None
    return list(timer.log)


def ours_decode(engine, timer, prompts, new_tokens):
    log = ours_run(engine, timer, prompts, new_tokens + 1, prefill_budget=1 << 16)
    steps = [t for ph, b, _, t in log if ph == "decode" and b == len(prompts)]
    return len(prompts) / statistics.median(steps)


def ours_prefill(engine, timer, prompts, reps):
    rates = []
    for _ in range(reps):
        log = ours_run(engine, timer, prompts, 1, prefill_budget=1 << 16)
        pre = [(n, t) for ph, _, n, t in log if ph == "prefill"]
        rates.append(sum(n for n, _ in pre) / sum(t for _, t in pre))
    return statistics.median(rates)


class StepClock:
    "A logits processor that only records when each generate step reaches it."
    def __init__(self): self.stamps = []
    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter()); return scores


def hf_decode(hf, prompts, new_tokens):
    from transformers import LogitsProcessorList
    clock = StepClock()
    x = torch.tensor(prompts)
    with torch.inference_mode():
        hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens + 1, do_sample=False,
                    logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    return len(prompts) / statistics.median(steps)


def hf_prefill(hf, prompts, reps):
    x = torch.tensor(prompts)
    ts = []
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=0)
            ts.append(time.perf_counter() - t)
    return x.numel() / statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the decode runs")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode steps measured per run")
    ap.add_argument("--prefill-batch", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the prefill measurements")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF columns")
    ap.add_argument("--omp-passive", action="store_true", help="run with OMP_WAIT_POLICY=PASSIVE (both engines)")
    ap.add_argument("--bound-reps", type=int, default=5,
                    help="(bandwidth, single-request decode) pairs measured for the bound column")
    args = ap.parse_args()
    if args.threads: torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    bw = measure_bandwidth()
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, read bandwidth {bw:.1f} GB/s "
          f"(best median of 7 sum / amax reads of 1 GiB, all threads or one)", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for dt in args.dtypes.split(","):
        torch.manual_seed(0)
        engine = Engine(EngineConfig(dtype=dt, device="cpu", page_size=16,
                                     max_running_reqs=max(batches + [args.prefill_batch]),
                                     max_seq_len=max(args.prompt_len + args.new_tokens + 2, args.prefill_len + 2)),
                        progress=True)
        timer = Timed(engine)
        tok = engine.tokenizer
        hf = None
        if not args.no_hf:
            hf = AutoModelForCausalLM.from_pretrained(engine.model_dir, dtype=engine.dtype).eval()
            hf.generation_config.eos_token_id = None      # like ignore_eos: every run has the same length
        weight_bytes = model_bytes(engine.model.cfg, engine.dtype.itemsize)
        ours_run(engine, timer, prompts_of(tok, 2, 16), 4, 1 << 16)       # warm-up
        for b in batches:
            ps = prompts_of(tok, b, args.prompt_len)
            if b == 1:
                # The machine is shared and its bandwidth drifts: pair each decode run with a bandwidth
                # measurement taken just before it, and report the median of the per-pair ratios.
                pairs = []
                for _ in range(args.bound_reps):
                    bw_i = measure_bandwidth(reps=5)
                    pairs.append((ours_decode(engine, timer, ps, args.new_tokens), bw_i * 1e9 / weight_bytes))
                o = statistics.median(t for t, _ in pairs)
                bound = statistics.median(bd for _, bd in pairs)
                frac = statistics.median(t / bd for t, bd in pairs)
                print(f"  {dt} decode batch 1 vs bound, per pair: "
                      + ", ".join(f"{t:.1f}/{bd:.1f}" for t, bd in pairs), flush=True)
            else:
                o = ours_decode(engine, timer, ps, args.new_tokens)
            h = hf_decode(hf, ps, args.new_tokens) if hf is not None else float("nan")
            rows.append((dt, f"decode batch {b}", o, h, (bound, frac) if b == 1 else None))
            print(f"  {dt} decode batch {b}: ours {o:.1f} tok/s, HF {h:.1f} tok/s", flush=True)
        ps = prompts_of(tok, args.prefill_batch, args.prefill_len)
        o = ours_prefill(engine, timer, ps, args.reps)
        h = hf_prefill(hf, ps, args.reps) if hf is not None else float("nan")
        rows.append((dt, f"prefill {args.prefill_batch}x{args.prefill_len}", o, h, None))
        print(f"  {dt} prefill: ours {o:.0f} tok/s, HF {h:.0f} tok/s", flush=True)
        del engine, hf

    print()
    print(f"| dtype | measurement | minisgl tok/s | HF generate tok/s | minisgl / HF | bandwidth bound tok/s | minisgl / bound |")
    print(f"|---|---|---:|---:|---:|---:|---:|")
    for dt, what, o, h, bd in rows:
        b1 = f"{bd[0]:.1f} | {bd[1]:.0%}" if bd else " | "
        print(f"| {dt} | {what} | {o:.1f} | {h:.1f} | {o / h:.2f}x | {b1} |")


if __name__ == "__main__":
    main()
