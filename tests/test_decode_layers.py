"""`decode_layers` (csrc/cpu/decode.cpp): all decoder layers of a bf16 decode step in one C++ call and one parallel
region. It calls the same kernels in the same order as `CausalLM._decode_layers`, so its results must be the
Python loop's bits exactly: on random models with and without biases, over plain weights (the GEMV) and packed
tiles (batches up to 64), on the real default model, with one thread or two, from two Python threads at once (it
releases the GIL), under the overlap scheduler, after a weight changed under the `DecodeStep` a model keeps between
steps; and a bad argument, including one only found inside the parallel
region, must come back as a clear error."""
import dataclasses
import threading

import pytest
import torch

from minisgl import kernels
from minisgl.models import CausalLM, ForwardContext, ModelConfig

EXT = kernels.native()
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "decode_layers"),
                                reason="minisgl._C not built (pip install --no-build-isolation -e .)")


def tiny(model_type, layers=3, seed=0):
    cfg = ModelConfig.from_hf({'model_type': model_type, 'vocab_size': 64, 'hidden_size': 64, 'intermediate_size': 96,
                               'num_hidden_layers': layers, 'num_attention_heads': 4, 'num_key_value_heads': 2,
                               'head_dim': 16, 'max_position_embeddings': 64})
    torch.manual_seed(seed)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.3)
            if 'norm' in name: p.add_(1)
    return m.to(torch.bfloat16)


def step_inputs(m, rows, seed=1, slots=64):
    "Caches holding a random history, a page table with one row per request, and one new token per request."
    g = torch.Generator().manual_seed(seed)
    cfg = m.cfg
    kv = [(torch.randn(slots, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16(),
           torch.randn(slots, cfg.num_kv_heads, cfg.head_dim, generator=g).bfloat16()) for _ in range(cfg.num_layers)]
    per = slots // rows
    page_table = torch.arange(rows * per, dtype=torch.int32).view(rows, per)
    seq_lens = torch.randint(1, per + 1, (rows,), generator=g).int()
    positions = (seq_lens - 1).long()
    out_loc = page_table[torch.arange(rows), positions].long()
    ctx = ForwardContext(False, out_loc, page_table, torch.arange(rows, dtype=torch.int32), seq_lens,
                         torch.ones(rows, dtype=torch.int32), kv, fused=True, positions=positions)
    x = m.embed_tokens(torch.randint(0, m.cfg.vocab_size, (rows,), generator=g))
    return x, ctx


def clone_ctx(ctx):
    return ForwardContext(**{**ctx.__dict__, 'kv_caches': [(k.clone(), v.clone()) for k, v in ctx.kv_caches]})


def run(m, x, ctx, native):
    with torch.inference_mode():
        return (m._decode_layers_native if native else m._decode_layers)(x.clone(), ctx)


def assert_same(m, x, ctx):
    c0, c1 = clone_ctx(ctx), clone_ctx(ctx)
    (x0, r0), (x1, r1) = run(m, x, c0, False), run(m, x, c1, True)
    assert torch.equal(x0, x1) and torch.equal(r0, r1)
    for (k0, v0), (k1, v1) in zip(c0.kv_caches, c1.kv_caches):   # the same K/V written to the same slots
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert not torch.equal(c1.kv_caches[0][0], ctx.kv_caches[0][0])   # ... and something was written
    return x1


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])   # qwen2: q/k/v biases
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_native_equals_python_loop(model_type, rows):
    m = tiny(model_type)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"): p.normal_()
    x, ctx = step_inputs(m, rows)
    assert_same(m, x, ctx)


def test_thread_counts():
    m = tiny("llama")
    x, ctx = step_inputs(m, 2)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in sorted({1, 2, threads}):
            torch.set_num_threads(n)
            outs.append(assert_same(m, x, ctx))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, outs[0]) for o in outs)   # the split of the GEMVs does not change a bit


def test_two_python_threads_at_once():
    "The GIL is released during the step: two threads decode two models at once, each as it would alone."
    models = [tiny("llama", layers=6, seed=s) for s in (0, 1)]
    inputs = [step_inputs(m, 1, seed=s) for s, m in enumerate(models)]
    want = [run(m, x, clone_ctx(c), True)[0] for m, (x, c) in zip(models, inputs)]
    got, errors = [[] for _ in models], []

    def work(i):
        try:
            for _ in range(20): got[i].append(run(models[i], inputs[i][0], clone_ctx(inputs[i][1]), True)[0])
        except Exception as e:   # surfaced by the assert below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts: t.start()
    for t in ts: t.join(60)
    assert not errors and not any(t.is_alive() for t in ts)
    assert all(torch.equal(o, want[i]) for i in range(2) for o in got[i])


def test_real_model_step():
    "The default model (bf16): one decode step of the native loop equals the Python loop's, bit for bit."
    from minisgl.engine import Engine, EngineConfig
    # kernels forced to the GEMV: a measured plan may pick oneDNN for 2 rows (it did, on a loaded machine), and then the
    # engine runs the step layer by layer, never through the native loop this test compares
    eng = Engine(EngineConfig(dtype="bfloat16", device="cpu", max_running_reqs=2, max_seq_len=64, num_pages=8, kernels="gemv"),
                 progress=False)
    m = eng.model
    g = torch.Generator().manual_seed(0)
    for k, v in eng.kv_caches: k.copy_(torch.randn(k.shape, generator=g)); v.copy_(torch.randn(v.shape, generator=g))
    page_table = torch.arange(128, dtype=torch.int32).view(2, 64)
    ctx = ForwardContext(False, torch.tensor([40, 64 + 10]), page_table, torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([41, 11], dtype=torch.int32), torch.ones(2, dtype=torch.int32), eng.kv_caches,
                         fused=True, positions=torch.tensor([40, 10]))
    x = m.embed_tokens(torch.tensor([504, 1932]))
    assert_same(m, x, ctx)


def test_bound_step_follows_its_weights():
    """The `DecodeStep` a model keeps between steps plans again when a weight changes under it: a bias written in
    place (as `load_state_dict` does) and a weight given new storage (as `.to()` or `.data =` do) reach the next
    step, whose bits are again the Python loop's."""
    m = tiny("qwen2")                      # qwen2: qkv_proj has a bias, which the step holds as an fp32 copy
    x, ctx = step_inputs(m, 2)
    before = run(m, x, clone_ctx(ctx), True)
    assert len(m._native_args) == 1
    with torch.no_grad():
        m.layers[1].self_attn.qkv_proj.bias.add_(0.5)
        w = m.layers[2].mlp.down_proj.weight
        w.data = w.data * 2                # new storage: the pointer the built plan held is gone
    after = run(m, x, clone_ctx(ctx), True)
    assert len(m._native_args) == 1        # the same step object, planned again
    assert not torch.equal(after[0], before[0])
    assert torch.equal(after[0], run(m, x, clone_ctx(ctx), False)[0])


def args_of(m, x, ctx):
    "decode_layers' arguments for a step on copies of x and of the caches (the step writes into both)."
    m._decode_layers_native(x.clone(), clone_ctx(ctx))   # fills m._native_args
    x, ctx = x.clone(), clone_ctx(ctx)
    a = m.layers[0].self_attn
    (weights, _, _), = m._native_args.values()   # one choice of kernels: the plain weights (the GEMV)
    return dict(x=x, weights=list(weights), eps=m.cfg.rms_norm_eps,
                k_caches=[k for k, _ in ctx.kv_caches], v_caches=[v for _, v in ctx.kv_caches],
                cos=m.rotary.cos, sin=m.rotary.sin, positions=ctx.positions, out_loc=ctx.out_loc,
                page_table=ctx.page_table, table_idx=ctx.table_idx, seq_lens=ctx.seq_lens,
                num_q_heads=a.num_heads, num_kv_heads=a.num_kv_heads, scale=a.scale,
                sliding_windows=[-1] * m.cfg.num_layers)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(weights=a["weights"][:-1]), "weights per layer"),
    (lambda a: a["weights"].__setitem__(1, a["weights"][1].float()), "bfloat16"),
    (lambda a: a["weights"].__setitem__(3, a["weights"][3][:, :8].contiguous()), "shape"),
    (lambda a: a["weights"].__setitem__(1, None), "qkv_proj of layer 0 is missing"),
    (lambda a: a["weights"].__setitem__(10, None), "input_layernorm of layer 1"),
    (lambda a: a.update(x=a["x"].float()), "bfloat16"),
    (lambda a: a.update(x=a["x"].repeat(40, 1)), "rows"),
    (lambda a: a.update(out_loc=a["out_loc"] + 1000), "out_loc"),
    (lambda a: a.update(positions=a["positions"] + 1000), "position"),
    (lambda a: a.update(v_caches=a["v_caches"][:-1]), "one entry per layer"),
    # only found by the attention kernel, on thread 0 inside the parallel region: must still come back
    (lambda a: a.update(table_idx=a["table_idx"] + 5), "table_idx"),
    (lambda a: a.update(seq_lens=a["seq_lens"] * 0), "seq_lens"),
])
def test_bad_arguments_raise(change, match):
    m = tiny("llama")
    x, ctx = step_inputs(m, 2)
    args = args_of(m, x, ctx)
    change(args)
    with pytest.raises(RuntimeError, match=match): EXT.decode_layers(**args)
    args = args_of(m, x, ctx)   # and the next good call works
    assert torch.equal(EXT.decode_layers(**args)[0], run(m, x, clone_ctx(ctx), False)[0])


class _WithoutNative:
    "minisgl._C without decode_layers: the model falls back to the Python loop."
    def __getattr__(self, name):
        if name == "decode_layers": raise AttributeError(name)
        return getattr(EXT, name)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_forward_logits_equal_python_path(model_type, monkeypatch):
    "A whole decode forward: the native call through the final norm and LM head gives the Python path's logits."
    m = tiny(model_type)
    x, ctx = step_inputs(m, 3)
    ids = torch.tensor([5, 9, 11])
    with torch.inference_mode():
        c_native = clone_ctx(ctx)
        native = m(ids, ctx.positions, dataclasses.replace(c_native, positions=None))
        monkeypatch.setattr(kernels, "native", lambda: _WithoutNative())
        c_py = clone_ctx(ctx)
        plain = m(ids, ctx.positions, dataclasses.replace(c_py, positions=None))
    assert native.dtype == plain.dtype == torch.float32 and native.shape == (3, m.cfg.vocab_size)
    assert torch.equal(native, plain)
    assert torch.equal(native, native.bfloat16().float())   # bf16 values, as lm_head(x).float() gives
    for (k0, v0), (k1, v1) in zip(c_native.kv_caches, c_py.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_forward_uses_native_head(monkeypatch):
    """The decode forward makes exactly one native call, which returns the logits (no separate LM-head GEMV); the
    `DecodeStep` it runs is built at the first step and reused by the next."""
    m = tiny("llama")
    x, ctx = step_inputs(m, 1)
    calls = []

    class Spy:
        def __getattr__(self, name):
            f = getattr(EXT, name)
            if name == "DecodeStep":   # building one is a call; so is every run of what it built
                def build(*a, **k):
                    calls.append("build DecodeStep")
                    step = f(*a, **k)
                    return lambda *a, **k: (calls.append("run DecodeStep"), step(*a, **k))[1]
                return build
            return (lambda *a, **k: (calls.append(name), f(*a, **k))[1]) if callable(f) else f

    monkeypatch.setattr(kernels, "native", lambda: Spy())
    monkeypatch.setattr(m.lm_head, "forward", lambda x: calls.append("lm_head") or torch.zeros(1))
    with torch.inference_mode(): logits = m(torch.tensor([3]), ctx.positions, clone_ctx(ctx))
    assert calls.count("run DecodeStep") == 1 and "lm_head" not in calls and "linear_gemv" not in calls
    assert logits.shape == (1, m.cfg.vocab_size)
    with torch.inference_mode(): again = m(torch.tensor([3]), ctx.positions, clone_ctx(ctx))
    assert calls.count("build DecodeStep") == 1 and calls.count("run DecodeStep") == 2
    assert torch.equal(again, logits)


needs_tiles = pytest.mark.skipif(EXT is None or not hasattr(EXT, "linear_packed") or not EXT.linear_packed_available(),
                                 reason="packed tiles need an x86 CPU with AVX2 and FMA")


@needs_tiles
@pytest.mark.parametrize("body", ["tiles", "amx"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 33, 64])
def test_native_over_packed_tiles(model_type, rows, body):
    """The engine's packed projections (chapter 08): batches up to 64 rows, row-split kernels, attention tasks on all
    threads; the tiles' products on AVX512-BF16 / AVX2 dot products, or on AMX where this CPU has it."""
    from minisgl.linear import amx_available, forced_plan, linear_specs, pack_linears
    if body == "amx" and not amx_available(): pytest.skip("no AMX on this CPU (or the OS refused its tile state)")
    m = tiny(model_type, seed=rows)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"): p.normal_()
    pack_linears(m, forced_plan(linear_specs(m, 64), body))
    assert m.layers[0].mlp.down_proj.tiles is not None and m.layers[0].mlp.down_proj.kernel_for(rows) == body
    x, ctx = step_inputs(m, rows, slots=8 * rows + 64)
    assert m._direct_decode(x, ctx)
    assert_same(m, x, ctx)
    # and the whole forward, through the LM head: the native call equals the Python loop's logits
    with torch.inference_mode():
        ids = torch.randint(0, m.cfg.vocab_size, (rows,))
        c1, c2 = clone_ctx(ctx), clone_ctx(ctx)
        native = m(ids, ctx.positions, c1)
        want = m(ids, ctx.positions, dataclasses.replace(c2, fused=False, backend='torch'))   # the torch reference
    torch.testing.assert_close(native, want, atol=0.15, rtol=0.05)   # bf16: fused vs torch rounding
    assert (native.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_bf16_engine_overlap_loop_same_tokens():
    """The default model in bf16 through the real scheduler: with the overlap loop the scheduler's Python thread
    runs while `decode_layers` (GIL released) computes the step; greedy tokens must equal the normal loop's, and
    the KV pool must be whole afterwards."""
    from minisgl.core import SamplingParams
    from minisgl.engine import Engine, EngineConfig
    from minisgl.messages import UserMsg
    from minisgl.scheduler import Scheduler, SchedulerConfig
    eng = Engine(EngineConfig(dtype="bfloat16", device="cpu", max_running_reqs=8, max_seq_len=256, quantization="none"), progress=False)
    text = "The history of computing is a story of people trying to make machines do arithmetic faster. " * 6
    ids = eng.tokenizer(text)["input_ids"]
    prompts = [ids[3 * i: 3 * i + n] for i, n in enumerate((1, 5, 17, 40, 64, 9, 100))]
    outs = []
    for overlap in (False, True):
        sched = Scheduler(eng, SchedulerConfig(max_running_reqs=8, prefill_budget=64, overlap=overlap))
        for i, p in enumerate(prompts):
            sched.submit(UserMsg(i, p, SamplingParams(max_tokens=24, ignore_eos=True)))
        res = sched.run_until_idle()
        sched.check_integrity()   # every page back in the free list or the prefix cache
        sched.close()
        outs.append([[o.token_id for o in res[i] if o.token_id is not None] for i in range(len(prompts))])
        assert all(len(o) == 24 for o in outs[-1])
    assert outs[0] == outs[1]


@needs_tiles
def test_engine_without_tiles_same_greedy_tokens():
    """A CPU where the tiles do not run (simulated with MINISGL_CPU_ISA=baseline, in a subprocess): the engine runs
    the GEMV and torch (or oneDNN); against it the engine forced onto the tiles. Greedy bf16 decoding of the default model must agree with the
    tiled engine token for token, except where the two part at a near tie (the kernels round differently):
    there each run's pick must be the other's runner-up, within 0.2 in log-probability."""
    import json
    import os
    import subprocess
    import sys
    code = r'''
import json
import torch
from minisgl import _C
from minisgl.core import SamplingParams
from minisgl.llm import LLM
import os
llm = LLM(dtype="bfloat16", max_seq_len=128, kernels="gemv" if os.environ["MINISGL_CPU_ISA"] else "tiles")
lin = llm.engine.model.layers[0].mlp.down_proj
outs = llm.generate(["The capital of France is", "List three colors:", "def fib(n):", "Once upon a time"],
                    SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3), use_tqdm=False)
print(json.dumps({"tiles": _C.linear_packed_available() and lin.tiles is not None,
                  "tokens": [o.token_ids for o in outs], "top": [o.outputs[0].top_logprobs for o in outs]}))
'''
    runs = {}
    for cap in ("baseline", ""):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "MINISGL_CPU_ISA": cap})
        assert r.returncode == 0, r.stderr[-2000:]
        runs[cap] = json.loads(r.stdout.strip().splitlines()[-1])
    assert runs[""]["tiles"] and not runs["baseline"]["tiles"]
    a, b = runs["baseline"], runs[""]
    for ta, tb, pa, pb in zip(a["tokens"], b["tokens"], a["top"], b["top"]):
        assert len(ta) == len(tb) == 12
        diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if diff is None: continue
        (a1, la), (b1, lb) = pa[diff][0], pb[diff][0]   # each run's pick (greedy: its best)
        near_a, near_b = dict(pa[diff]), dict(pb[diff])
        assert b1 in near_a and la - near_a[b1] < 0.2, (diff, pa[diff], pb[diff])
        assert a1 in near_b and lb - near_b[a1] < 0.2, (diff, pa[diff], pb[diff])
