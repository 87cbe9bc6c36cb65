"""Tensor parallel on this machine: TP=1 against TP=2 (shared-memory all-reduce, and gloo's), default model.

Three figures per setting, each the median of `--reps` runs, in one run of the script (the machine is shared and
noisy: compare the ratios): single-request decode tokens/s, a batch of 16 requests' output tokens/s (decode-bound),
and prefill tokens/s of 4 prompts of 256 tokens. Plus the cost of one all-reduce of a decode row and of a
64-token chunk between two ranks, shared memory vs gloo.

    .venv/bin/python benchmarks/bench_tp.py                     # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_tp.py --out benchmarks/results/tp.json

What 2 cores can show: the ranks split the same two cores, so TP=2 does the same arithmetic with one core each plus
the collectives; it cannot beat TP=1 here. Where each rank has cores and memory bandwidth of its own (a socket, a
GPU), a decode step reads every weight once, and each rank reads 1/N of them.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(__file__))
from bench_workload import machine  # noqa: E402


def _collective_rank(rank: int, kind: str, addr: str, q):
    import torch
    from minisgl.engine import EngineConfig
    from minisgl.models import ModelConfig
    from minisgl.tp import ShardPlan, init_tp_group
    torch.set_num_threads(1)
    cfg = EngineConfig(tp_size=2, dist_init_addr=addr, tp_allreduce=kind)
    full = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=1,
                       num_heads=9, num_kv_heads=3, head_dim=64)
    g = init_tp_group(cfg, rank, ShardPlan.of(full, rank, 2), torch.device("cpu"), 576 * 4096)
    out = {}
    for rows in (1, 64):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        for _ in range(50): g.all_reduce(x)
        ts = []
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(200): g.all_reduce(x)
            ts.append((time.perf_counter() - t) / 200)
        out[rows] = statistics.median(ts) * 1e6
    if rank == 0: q.put(out)
    import torch.distributed as dist
    dist.destroy_process_group()


def collectives(kind: str) -> dict:
    "Microseconds per bf16 all-reduce of [rows, 576] between two ranks, by rows."
    import multiprocessing as mp
    from minisgl.tp import free_init_addr
    ctx, addr = mp.get_context("spawn"), free_init_addr()
    q = ctx.Queue()
    ps = [ctx.Process(target=_collective_rank, args=(r, kind, addr, q)) for r in range(2)]
    for p in ps: p.start()
    out = q.get(timeout=300)
    for p in ps: p.join(30)
    return out


def engine_figures(tp: int, allreduce: str, reps: int, new: int) -> dict:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(100, 49152) for _ in range(n)]
    with LLM(tp_size=tp, tp_allreduce=allreduce, max_running_reqs=16) as llm:
        sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        llm.generate([prompt(32)] * 2, sp, use_tqdm=False)           # warm-up
        def rate(prompts, sp, count):
            ts = []
            for _ in range(reps):
                t = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False); ts.append(time.perf_counter() - t)
            return count(outs) / statistics.median(ts)
        single = rate([prompt(32)], sp, lambda o: sum(len(x.token_ids) for x in o))
        batch = rate([prompt(32) for _ in range(16)], sp, lambda o: sum(len(x.token_ids) for x in o))
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        prefill = rate([prompt(256) for _ in range(4)], one, lambda o: 4 * 256)
    return {"decode_1_tok_s": single, "batch_16_tok_s": batch, "prefill_tok_s": prefill}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = {"machine": machine(), "collectives_us": {}, "engine": {}}
    for kind in ("shm", "backend"):
        res["collectives_us"][kind] = collectives(kind)
        print(f"all-reduce, 2 ranks, {kind:>7}: " + ", ".join(f"{r} rows {us:.0f} us" for r, us in res["collectives_us"][kind].items()), flush=True)
    for name, tp, ar in (("tp1", 1, "auto"), ("tp2_shm", 2, "shm"), ("tp2_gloo", 2, "backend")):
        res["engine"][name] = f = engine_figures(tp, ar, a.reps, a.new_tokens)
        print(f"{name:>9}: decode 1 request {f['decode_1_tok_s']:.1f} tok/s, 16 requests {f['batch_16_tok_s']:.1f} tok/s, "
              f"prefill {f['prefill_tok_s']:.0f} tok/s", flush=True)
    base = res["engine"]["tp1"]
    for name in ("tp2_shm", "tp2_gloo"):
        f = res["engine"][name]
        print(f"{name} / tp1: " + ", ".join(f"{k} {f[k] / base[k]:.2f}x" for k in base))
    print(f"CPU: {res['machine']['cpu']}, {res['machine']['cores']} cores, torch {res['machine']['torch']}")
    if a.out:
        with open(a.out, "w") as fh: json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
