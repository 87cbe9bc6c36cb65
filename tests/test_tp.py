"""Tensor parallel on gloo (chapter tensor_parallel): TP=2 against TP=1, the fast paths per rank, a server with
--tp 2, a rank that dies or hangs, and two "machines" on loopback.

fp32 greedy tokens of TP=2 must equal TP=1's up to a near tie: where they first differ, TP=1's two best tokens
must be within `TIE` in log-probability and TP=2's token one of them (the sums are the same, added in another
order; after a tie is broken differently the rest of the text may differ, so the comparison stops there).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from minisgl.core import ParamError, SamplingParams
from minisgl.engine import EngineArgs
from minisgl.llm import LLM
from minisgl.models import ModelConfig
from minisgl.tp import ShardPlan, free_init_addr
from minisgl.weights import load_hf_config, load_tokenizer, resolve_model
from server_utils import ENV, ServerProc, alive, survivors

TIE = 1e-3
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "A short poem about the sea:\n",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,"]


def run(model, tp, n=20, dtype="float32", **kw):
    "Greedy tokens (and, for TP=1, the two best logprobs per step) of `PROMPTS` on `tp` ranks."
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, top_logprobs=2 if tp == 1 else 0)
    with LLM(model, dtype=dtype, tp_size=tp, max_running_reqs=4, quantization="none", **kw) as llm:
        outs = llm.generate(PROMPTS, sp)
        path = llm.engine.model.last_path
    return outs, path


def same_or_tie(tp2, tp1, tok, what):
    for k, (a, b) in enumerate(zip(tp2, tp1)):
        ours, ref = a.token_ids, b.token_ids
        assert len(ours) == len(ref), what
        i = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
        if i is None: continue
        (t1, lp1), (t2, lp2) = b.outputs[0].top_logprobs[i][:2]
        assert abs(lp1 - lp2) < TIE, f"{what}, prompt {k}: TP=2 differs at token {i} where TP=1's margin is {abs(lp1 - lp2):.4f}"
        assert tok.decode([ours[i]]) in (t1, t2), f"{what}, prompt {k}: TP=2's token {i} is not among TP=1's two best"


@pytest.fixture(scope="module")
def tokenizer_files():
    d = resolve_model(None, progress=False)
    return [p for p in d.iterdir() if p.name.startswith(("tokenizer", "special_tokens"))]


SMALL = dict(hidden_size=64, intermediate_size=97, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
             initializer_range=0.1, vocab_size=49155)    # 97 MLP columns and 49155 tokens: uneven splits and vocabulary padding
TINY = {
    "llama": lambda: LlamaConfig(**SMALL, num_key_value_heads=2, attention_bias=True, mlp_bias=True),   # row-parallel biases
    "qwen2": lambda: Qwen2Config(**SMALL, num_key_value_heads=1),          # one KV head over two ranks: replicated
    "qwen3": lambda: Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
}


@pytest.mark.parametrize("kind", list(TINY))
def test_tp2_matches_tp1_on_random_tiny_models(kind, tmp_path, tokenizer_files):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(TINY[kind]())
    hf.save_pretrained(tmp_path)
    for f in tokenizer_files: shutil.copy(f, tmp_path / f.name)
    cfg = ModelConfig.from_hf(load_hf_config(tmp_path))
    assert [ShardPlan.of(cfg, r, 2).kv_heads for r in range(2)] == ([(0, 1), (0, 1)] if kind == "qwen2" else [(0, 1), (1, 2)])
    tp1, _ = run(str(tmp_path), 1)
    tp2, _ = run(str(tmp_path), 2)
    same_or_tie(tp2, tp1, load_tokenizer(tmp_path), kind)


def test_tp2_matches_tp1_on_the_default_model_fp32():
    tp1, _ = run(None, 1, n=12)
    tp2, path = run(None, 2, n=12)
    same_or_tie(tp2, tp1, load_tokenizer(None), "SmolLM2-135M fp32")
    assert path == "fused layers"        # fp32 has no bf16 kernels, but the fused C++ element-wise ops stay in use


def test_fast_paths_stay_in_use_on_every_rank(capfd, caplog):
    "bf16: rank 0's decode steps take the fused decode path, and so do rank 1's (it says so when it stops, at info level)."
    caplog.set_level("INFO", logger="minisgl")          # LLM's follower ranks log at the level this process does
    outs, path = run(None, 2, n=8, dtype="bfloat16", kernels="gemv")
    assert path == "fused decode"
    assert all(len(o.token_ids) == 8 for o in outs)
    err = capfd.readouterr().err
    line = next(l for l in err.splitlines() if "rank 1 ran" in l)
    done = dict(kv.split(": ") for kv in line.split("(")[1].split(")")[0].split(", "))
    assert int(done.get("fused decode", 0)) == 7, line       # 8 tokens: one prefill, then 7 decode steps
    assert sum(map(int, done.values())) == 8 and "modules" not in done, line    # and nothing else: rank 0's forwards


def test_bad_tp_arguments_are_clear_errors():
    with pytest.raises(ParamError, match="tp_size"): EngineArgs(tp_size=0)
    with pytest.raises(ParamError, match="dist_init_addr.*nnodes 2"): EngineArgs(tp_size=2, nnodes=2)
    with pytest.raises(ParamError, match="nnodes"): EngineArgs(tp_size=3, nnodes=2)
    with pytest.raises(ParamError, match="node_rank"): EngineArgs(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ParamError, match="HOST:PORT"): EngineArgs(tp_size=2, dist_init_addr="nohost")
    with pytest.raises(ParamError, match="too many"): LLM(tp_size=10)     # SmolLM2: 3 query heads a group, 4 ranks on one
    with pytest.raises(ParamError, match="TPEngine"):
        from minisgl.engine import Engine
        Engine(EngineArgs(tp_size=2))


def _workers(server) -> dict:
    return httpx.get(server.base + "/debug/scheduler", timeout=10).json()["workers"]


def _wait(cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout: return False
        time.sleep(0.2)
    return True


def _chat(base, text="What is the capital of France?", n=12):
    return httpx.post(base + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0})


def test_server_tp2_answers_and_a_dead_rank_stops_it():
    s = ServerProc("--tp", "2", "--max-running-requests", "4", "--kernels", "gemv")
    try:
        workers = _workers(s)
        assert set(workers) == {"minisgl-tokenizer", "minisgl-scheduler", "minisgl-tp-rank1"}
        r = _chat(s.base)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] and r.json()["usage"]["completion_tokens"] > 0
        os.kill(workers["minisgl-tp-rank1"], signal.SIGKILL)
        assert _wait(lambda: s.proc.poll() is not None), "the server kept running without its rank 1"
        assert s.proc.returncode == 1
        assert "minisgl-tp-rank1" in s.output() and "died" in s.output()
        assert not survivors(list(workers.values()), 20), "a worker outlived the server"
    finally:
        s.kill()


def test_a_hung_rank_fails_the_forward_within_the_dist_timeout():
    "Rank 1 stopped (SIGSTOP): rank 0's next forward waits --dist-timeout for it, then raises `RankFailure`, not a hang."
    from minisgl.tp import RankFailure
    with LLM(tp_size=2, max_running_reqs=4, kernels="gemv", dist_timeout=3) as llm:
        rank1 = llm.followers[0]
        assert len(llm.generate("Hello", SamplingParams(max_tokens=2))[0].token_ids) == 2
        os.kill(rank1.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RankFailure, match="(?i)timed out|did not arrive"):
                llm.generate("Hello again", SamplingParams(max_tokens=2))
            waited = time.monotonic() - t0
        finally:
            os.kill(rank1.pid, signal.SIGCONT)
    assert waited >= 3, waited           # it did wait for the rank, as long as it was told to
    rank1.join(20)
    assert not rank1.is_alive()          # closing after a failure still stops the rank (rank 0 is gone)


def test_two_machines_on_loopback():
    "Node 1 runs rank 1 only (no HTTP); node 0 serves; stopping node 0 stops node 1 cleanly."
    addr = free_init_addr()
    node1 = subprocess.Popen([sys.executable, "-m", "minisgl", "serve", "--tp", "2", "--nnodes", "2", "--node-rank", "1",
                              "--dist-init-addr", addr, "--kernels", "gemv", "--max-running-requests", "4"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True)
    try:
        s = ServerProc("--tp", "2", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", addr,
                       "--kernels", "gemv", "--max-running-requests", "4")
        try:
            workers = _workers(s)
            assert set(workers) == {"minisgl-tokenizer", "minisgl-scheduler"}    # rank 1 is the other machine's
            r = _chat(s.base)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        finally:
            assert s.stop() == 0
        assert not survivors(list(workers.values())), "node 0 left a worker behind"
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out
        assert "rank 1 ran" in out and "ranks stopped" in out, out
    finally:
        if node1.poll() is None: os.killpg(node1.pid, signal.SIGKILL); node1.wait()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL, one rank per GPU)")
def test_tp2_on_two_gpus_matches_tp1():
    tp1, _ = run(None, 1, n=24, device="cuda")
    tp2, _ = run(None, 2, n=24, device="cuda")
    same_or_tie(tp2, tp1, load_tokenizer(None), "SmolLM2-135M fp32 on CUDA")


def _shm_rank(rank, size, addr, q, die_at):
    import datetime
    import torch.distributed as dist
    from minisgl.tp import ShmExchange
    dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    ex = ShmExchange(rank, size, "minisgl-test-" + addr.replace(":", "-"), 64, 30.0, dist.group.WORLD)
    out = {"too_big": ex.all_reduce(torch.zeros(65))}
    try:
        for i in range(4):
            x = torch.full((2, 8), float(rank + 1 + i), dtype=torch.bfloat16)
            assert ex.all_reduce(x)
            out[f"sum{i}"] = x.float().tolist()
            g = ex.gather(torch.full((1, 4), float(rank)))
            out[f"gather{i}"] = g.tolist() if rank == 0 else g
            if rank == die_at and i == 1: os._exit(0)          # gone without a word
    except RuntimeError as e:
        out["error"] = str(e)
    q.put((rank, out))


def test_shared_memory_exchange():
    "3 ranks: sums and gathers equal the reference on every rank, sizes past the slots decline; a rank that dies is named."
    import multiprocessing as mp
    ctx, addr, size, die_at = mp.get_context("spawn"), free_init_addr(), 3, 2
    q = ctx.Queue()
    ps = [ctx.Process(target=_shm_rank, args=(r, size, addr, q, die_at)) for r in range(size)]
    for p in ps: p.start()
    outs = dict(q.get(timeout=120) for _ in range(size - 1))
    for p in ps: p.join(30)
    for r, out in outs.items():
        assert out["too_big"] is False
        for i in range(2):                                       # before rank 2 went
            assert out[f"sum{i}"] == [[float(sum(k + 1 + i for k in range(size)))] * 8] * 2
        if r == 0: assert out["gather0"] == out["gather1"] == [[[float(k)] * 4] for k in range(size)]
        assert "sum2" not in out and f"rank {die_at}" in out["error"] and "gone" in out["error"], out
    assert not list(__import__("pathlib").Path("/dev/shm").glob("minisgl-test-*"))    # unlinked once all had mapped it
