"""Kernel plans (nbs/04c_linear.ipynb): every candidate against the reference on the shapes it may be picked for;
a forced choice of each candidate gives the default plan's greedy tokens up to near ties; the plan cache is
read back, and a corrupt, truncated or stale file is measured anew; the layouts a linear keeps follow the plan;
the fused decode step follows the plan's picks; `minisgl tune` prints the plan."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from minisgl import kernels
from minisgl.linear import (KERNELS, LAYOUT, NATIVE_KERNELS, ROW_BUCKETS, LinearSpec, PackedLinear, choose_kernels, forced_plan,
                            kernel_plan, kernel_runs, linear_ref, linear_specs, measure_linear, pack_linears, pack_weight,
                            plan_cache_file, run_linear)

ROOT = Path(__file__).resolve().parents[1]
EXT = kernels.native()
pytestmark = pytest.mark.skipif(EXT is None or not hasattr(EXT, "linear_gemv"), reason="minisgl._C not built")
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    "An empty kernel-plan cache; converted models are linked in from the real cache (a conversion is not what is tested)."
    from minisgl.weights import cache_root
    for p in cache_root().glob("*"):
        if p.is_dir() and (p / "source.json").exists(): (tmp_path / p.name).symlink_to(p)
    monkeypatch.setenv("MINISGL_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("kernel", KERNELS)
def test_candidate_matches_reference(kernel):
    "Each candidate, on the default model's shapes, at the bucket sizes it may be picked for (and between them)."
    if not kernel_runs(kernel, 1, 576): pytest.skip(f"{kernel} does not run bf16 on this CPU (so it is never picked here)")
    g = torch.Generator().manual_seed(0)
    for n, k in MODEL_SHAPES:
        w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
        b = torch.randn(n, generator=g).bfloat16()
        wl = pack_weight(LAYOUT[kernel], w)
        for rows in (1, 3, 5, 8, 33, 64, 300) if n < 10000 else (1, 4, 8, 32):
            if not kernel_runs(kernel, rows, k): continue
            x = torch.randn(rows, k, generator=g).bfloat16()
            y = run_linear(kernel, x, wl, n, b)
            assert y.shape == (rows, n) and y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), linear_ref(x, w, b).float(), atol=0.03, rtol=0.02)


def test_choose_kernels_bounds_layouts():
    times = {"gemv": {1: 1.0, 8: 2.0}, "tiles": {1: 1.2, 8: 1.0, 256: 9.0}, "onednn": {1: 3.0, 8: 3.0, 256: 5.0},
             "torch": {1: 4.0, 8: 4.0, 256: 5.1}}
    for max_layouts in (1, 2, 3):
        picks = choose_kernels(times, max_layouts)
        assert [m for m, _ in picks] == [1, 8, 256]
        assert len({LAYOUT[k] for _, k in picks}) <= max_layouts
    # oneDNN's own layout would gain 2% at 256 rows: not worth a third copy of the weights (3% is the bar)
    assert choose_kernels(times, 3) == [(1, "gemv"), (8, "tiles"), (256, "torch")]
    times["torch"][256] = 6.0
    assert choose_kernels(times, 3) == [(1, "gemv"), (8, "tiles"), (256, "onednn")]
    assert choose_kernels(times, 2) == [(1, "tiles"), (8, "tiles"), (256, "onednn")]
    # a free plain layout (a tied LM head's) is always there to use
    # with plain free, one more layout: tiles (worst case 1.2x, torch at 256) beats oneDNN's (2x at 8 rows)
    assert choose_kernels(times, 1, free=("plain",)) == [(1, "gemv"), (8, "tiles"), (256, "torch")]
    with pytest.raises(ValueError, match="max_layouts"): choose_kernels(times, 0)
    with pytest.raises(ValueError, match="no timings"): choose_kernels({}, 2)


def tiny_specs():
    return {(48, 32): LinearSpec(2, 64), (32, 64): LinearSpec(1, 8)}


def test_cache_round_trip_and_bad_files(cache, caplog):
    specs = tiny_specs()
    with caplog.at_level(logging.INFO, logger="minisgl.linear"):
        first = kernel_plan(specs)
    assert first.source == "measured" and "measuring the matmul kernels" in caplog.text
    path = plan_cache_file(specs)
    assert path.exists() and path.parent == cache / "kernel-plans"
    again = kernel_plan(specs)
    assert again.source.startswith("cache") and again.choices == first.choices and again.times == first.times
    good = path.read_text()

    def remeasured(text):
        path.write_text(text)
        plan = kernel_plan(specs)
        assert plan.source == "measured", text[:80]
        json.loads(path.read_text())   # replaced by a well-formed file
        assert kernel_plan(specs).source.startswith("cache")

    remeasured("not json {")                          # corrupt
    remeasured(good[: len(good) // 2])                # truncated
    d = json.loads(good); d["key"]["signature"]["cpu"] = "another CPU"
    remeasured(json.dumps(d))                         # stale: measured elsewhere
    d = json.loads(good); d["key"]["signature"]["torch"] = "0.0"
    remeasured(json.dumps(d))                         # stale: another torch
    d = json.loads(good); shape = next(iter(d["times"])); kern = next(iter(d["times"][shape]))
    d["times"][shape][kern] = {m: -1.0 for m in d["times"][shape][kern]}
    remeasured(json.dumps(d))                         # nonsense timings
    d = json.loads(good); del d["times"][shape]
    remeasured(json.dumps(d))                         # a shape missing
    # 'measure' always measures; a forced kernel never reads or writes the cache
    assert kernel_plan(specs, "measure").source == "measured"
    path.unlink()
    assert kernel_plan(specs, "tiles" if kernel_runs("tiles", 1) else "onednn").source.startswith("forced")
    assert not path.exists()
    with pytest.raises(ValueError, match="kernels"): kernel_plan(specs, "fastest")


def test_cache_key_follows_the_isa_cap(cache):
    "A cap on the CPU's instructions (imitating a narrower CPU) is another machine: another file, and its own candidates."
    code = ("import json; from minisgl.linear import LinearSpec, kernel_plan, plan_cache_file; "
            "from minisgl import _C; s = {(48, 32): LinearSpec(2, 64)}; p = kernel_plan(s); "
            "print(json.dumps([str(plan_cache_file(s)), sorted({k for c in p.choices.values() for _, k in c}), "
            "sorted(p.times[(48, 32)]), _C.linear_packed_isa()]))")
    out = {}
    for cap in ("", "avx512", "baseline"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MINISGL_CPU_ISA": cap})
        assert r.returncode == 0, r.stderr[-2000:]
        out[cap] = json.loads(r.stdout.strip().splitlines()[-1])
    assert len({out[cap][0] for cap in out}) == 3
    assert "tiles" not in out["baseline"][2]   # not even a candidate there
    if EXT.linear_packed_available():
        assert "tiles" in out[""][2]
        # an AVX-512 CPU without BF16 runs the tiles' fp32 FMA body on zmm: 'fma' is then no other candidate; a cap is
        # a ceiling, so a CPU with AVX2 and no AVX-512 keeps its own body under it
        wide = out[""][3].startswith("avx512")
        assert out["avx512"][3] == ("avx512" if wide else out[""][3]) and "tiles" in out["avx512"][2]
        assert "fma" not in out["avx512"][2]
        if out[""][3] == "avx512bf16": assert "fma" in out[""][2]   # both bodies are timed where both run


def test_onednn_is_a_candidate_only_where_it_runs_bf16():
    "torch's oneDNN refuses bf16 without AVX-512 (or AVX-NE-CONVERT): there it is no candidate, and a plan is still measured."
    runs = kernel_runs("onednn", 8, 64)
    assert runs == (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    w, x = torch.randn(48, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    if runs:
        torch.testing.assert_close(run_linear("onednn", x, pack_weight("onednn", w), 48).float(),
                                   linear_ref(x, w).float(), atol=0.03, rtol=0.02)
    else:
        with pytest.raises(RuntimeError): pack_weight("onednn", w)
    times = measure_linear(48, 64, [1, 8], reps=1)
    assert ("onednn" in times) == runs and "torch" in times


@pytest.mark.parametrize("slow_up_to,timed", [(10**9, [1, 2, 16]), (8, [1, 2, 16, 32, 64])])
def test_hopeless_candidates_stop_being_timed(monkeypatch, slow_up_to, timed):
    """From 16 rows on, a candidate 4x slower than the best is not timed at larger buckets (the plan took a minute
    without it); below 16 rows it is kept, since a kernel slow for a few rows may win for many (oneDNN on AMX)."""
    import types
    import minisgl.linear as L
    real, clock = L.run_linear, [0.0]
    def slow_torch(kern, x, *a, **k):   # a fake clock (a loaded machine must not change the verdict): torch 8x the others
        clock[0] += 8.0 if kern == "torch" and x.shape[0] <= slow_up_to else 1.0   # where it is slow, level elsewhere
        return real(kern, x, *a, **k)
    monkeypatch.setattr(L, "run_linear", slow_torch)
    monkeypatch.setattr(L, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = L.measure_linear(64, 64, [1, 2, 16, 32, 64], reps=1)
    assert sorted(times["torch"]) == timed
    assert any(sorted(t) == [1, 2, 16, 32, 64] for kern, t in times.items() if kern != "torch")


def test_packed_linear_keeps_only_its_layouts():
    lin = nn.Linear(64, 48).bfloat16().requires_grad_(False)
    x = torch.randn(100, 64).bfloat16()
    for choices in ([(8, "gemv"), (2048, "onednn")], [(2048, "onednn")], [(4, "torch"), (2048, "torch")]):
        if not all(kernel_runs(k, 1) for _, k in choices): continue
        pl = PackedLinear(lin, choices)
        layouts = {LAYOUT[k] for _, k in choices}
        assert (pl.weight is not None) == ("plain" in layouts)
        assert (pl.onednn is not None) == ("onednn" in layouts) and pl.tiles is None
        for rows in (1, 8, 9, 100):
            assert pl.kernel_for(rows) == (choices[0][1] if rows <= choices[0][0] else choices[-1][1])
            torch.testing.assert_close(pl(x[:rows]), lin(x[:rows]), atol=0.05, rtol=0.02)


def test_specs_of_a_tied_model():
    from minisgl.engine import model_linear_specs
    specs = model_linear_specs(None, 32)
    assert set(specs) == set(MODEL_SHAPES)
    assert specs[(960, 576)] == LinearSpec(30, ROW_BUCKETS[-1], ())
    assert specs[(49152, 576)] == LinearSpec(1, 64, ("plain",))   # tied to the embedding: the plain copy is free
    assert model_linear_specs(None, 100)[(49152, 576)].max_rows == 100


def tiny_model():
    from minisgl.models import CausalLM, ModelConfig
    cfg = ModelConfig.from_hf({'model_type': 'llama', 'vocab_size': 64, 'hidden_size': 64, 'intermediate_size': 96,
                               'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
                               'head_dim': 16, 'max_position_embeddings': 64})
    torch.manual_seed(0)
    return CausalLM(cfg).eval().to(torch.bfloat16)


@pytest.mark.skipif(not hasattr(EXT, "decode_layers"), reason="decode_layers not built")
def test_fused_decode_follows_the_plan():
    "The one-call decode step runs exactly where every layer pick is a native kernel; oneDNN picks go layer by layer."
    from minisgl.models import ForwardContext
    for kernel in KERNELS:
        m = tiny_model()
        pack_linears(m, forced_plan(linear_specs(m, 64), kernel))
        for rows in (1, 4, 8, 16, 64):
            ctx = ForwardContext(False, torch.arange(rows), torch.zeros(1, 1, dtype=torch.int32),
                                 torch.zeros(rows, dtype=torch.int32), torch.ones(rows, dtype=torch.int32),
                                 torch.ones(rows, dtype=torch.int32), [], fused=True)
            x = torch.zeros(rows, 64, dtype=torch.bfloat16)
            want = kernel in NATIVE_KERNELS and kernel_runs(kernel, rows, 64)   # else the plan fell back to oneDNN
            assert (m.layers[0].mlp.down_proj.kernel_for(rows) in NATIVE_KERNELS) == want
            assert m._direct_decode(x, ctx) == want, (kernel, rows)


PROMPTS = ["The capital of France is", "List three colors:", "def fib(n):", "Once upon a time, in a land far away, " * 4]


def test_forced_kernels_same_greedy_tokens():
    """The default model in bf16, greedy, with the measured plan and with each candidate forced: the same tokens,
    except where two runs part at a near tie (kernels sum in other orders); there each run's pick must be the
    other's runner-up, within 0.2 in log-probability."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3)
    runs = {}
    for kernel in ("auto", *[k for k in KERNELS if kernel_runs(k, 1, 576)]):
        llm = LLM(dtype="bfloat16", max_seq_len=256, max_running_reqs=8, kernels=kernel, quantization="none")
        assert llm.engine.kernel_plan is not None
        if kernel != "auto":
            assert llm.engine.kernel_plan.source == f"forced {kernel}"
            picks = {k for c in llm.engine.kernel_plan.choices.values() for _, k in c}
            assert kernel in picks
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        runs[kernel] = [(o.token_ids, o.outputs[0].top_logprobs) for o in outs]
        del llm
    base = runs.pop("auto")
    for kernel, outs in runs.items():
        for (ta, pa), (tb, pb) in zip(base, outs):
            assert len(ta) == len(tb) == 12
            diff = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
            if diff is None: continue
            (a1, la), (b1, lb) = pa[diff][0], pb[diff][0]
            near_a, near_b = dict(pa[diff]), dict(pb[diff])
            assert b1 in near_a and la - near_a[b1] < 0.2, (kernel, diff, pa[diff], pb[diff])
            assert a1 in near_b and lb - near_b[a1] < 0.2, (kernel, diff, pa[diff], pb[diff])


def test_engine_logs_its_plan(cache, caplog):
    from minisgl.engine import Engine, EngineConfig
    with caplog.at_level(logging.INFO):
        eng = Engine(EngineConfig(dtype="bfloat16", device="cpu", max_running_reqs=4, max_seq_len=64,
                                  kernel_layouts=1, quantization="none"), progress=False)
    assert "kernel plan (measured)" in caplog.text and "| rows |" in caplog.text
    assert eng.kernel_extra_bytes == 0   # one layout per linear
    for mod in eng.model.modules():
        if isinstance(mod, PackedLinear):
            kept = [t for t in (mod.weight, mod.tiles, mod.onednn) if t is not None]
            assert len(kept) == 1 or (len(kept) == 2 and mod.weight.data_ptr() == eng.model.embed_tokens.weight.data_ptr())
    with pytest.raises(ValueError, match="kernel_layouts"): EngineConfig(kernel_layouts=0)


def test_tune_command(cache):
    env = {**os.environ, "MINISGL_CACHE": str(cache)}
    show = subprocess.run([sys.executable, "-m", "minisgl", "tune", "--show"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert show.returncode == 0, show.stderr[-2000:]
    assert "measured now" in show.stdout and "| rows |" in show.stdout and "49152 x 576" in show.stdout
    assert "\nattention bodies, " in show.stdout and "  decode: " in show.stdout and "  extend: " in show.stdout
    again = subprocess.run([sys.executable, "-m", "minisgl", "tune", "--show"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=ROOT)
    assert again.returncode == 0 and "from the cache" in again.stdout
    assert "caches (ms a busy step of a layer, cache " in again.stdout   # the attention times read back too


def test_auto_dtype_follows_the_bf16_kernels():
    """dtype='auto' on a CPU is bf16 where the packed tiles run (AVX2 + FMA or wider) or oneDNN has bf16 dot products
    (AVX512-BF16, AMX), fp32 where neither (the baseline cap on a CPU without those)."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    onednn_bf16 = " amx_bf16" in cpuinfo or " avx512_bf16" in cpuinfo
    code = ("import torch; from minisgl import _C; from minisgl.engine import _resolve_dtype; "
            "print(_C.linear_packed_available(), _resolve_dtype('auto', torch.device('cpu')))")
    for cap in ("", "baseline"):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "MINISGL_CPU_ISA": cap})
        assert r.returncode == 0, r.stderr[-2000:]
        available, dtype = r.stdout.split()
        assert dtype == ("torch.bfloat16" if available == "True" or onednn_bf16 else "torch.float32")
        if cap == "baseline": assert available == "False"


def _count_calls(monkeypatch, slow=lambda kern, rows: False):
    "Record every `run_linear` call as (kernel, shape, rows, id of the weight); a fake clock: 8 units where `slow`, else 1."
    import types
    import minisgl.linear as L
    real, clock, calls = L.run_linear, [0.0], []
    def fake(kern, x, w, n, *a, **k):
        clock[0] += 8.0 if slow(kern, x.shape[0]) else 1.0
        calls.append((kern, (n, x.shape[1]), x.shape[0], id(w)))   # the weights live through the timing
        return real(kern, x, w, n, *a, **k)
    monkeypatch.setattr(L, "run_linear", fake)
    monkeypatch.setattr(L, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    return L, calls


def test_step_timing_passes_over_every_shape(monkeypatch):
    """`measure_step` runs one kernel through every shape in turn, each over `count` distinct copies (scaled down
    alike past `_STEP_BYTES`), and times a shape only at the buckets it will see."""
    L, calls = _count_calls(monkeypatch)
    specs = {(48, 32): LinearSpec(3, 64), (32, 64): LinearSpec(2, 8)}
    times = L.measure_step(specs, [1, 2, 16], reps=1)
    here = [kern for kern in KERNELS if kernel_runs(kern, 1, 32)]
    assert set(times[(48, 32)]) == set(here)
    for kern in here:
        assert sorted(times[(48, 32)][kern]) == [m for m in (1, 2, 16) if kernel_runs(kern, m, 32)]
        assert sorted(times[(32, 64)][kern]) == [m for m in (1, 2) if kernel_runs(kern, m, 64)]   # max_rows 8
    for kern in here:                  # `count` distinct copies, each run once per pass (2 passes: reps + warm-up)
        for shape, count in (((48, 32), 3), ((32, 64), 2)):
            mine = [c for c in calls if c[0] == kern and c[1] == shape and c[2] == 1]
            assert len(mine) == 2 * count and len({c[3] for c in mine}) == count
    # one pass = one kernel over both shapes: the kernel changes only between passes
    seq = [(c[0], c[1]) for c in calls if c[2] == 1]
    kern_runs = [k for i, (k, _) in enumerate(seq) if i == 0 or seq[i - 1][0] != k]
    assert len(kern_runs) == 2 * len(here)
    calls.clear()
    monkeypatch.setattr(L, "_STEP_BYTES", (48 * 32 * 3 + 32 * 64 * 2) * 2 // 3)   # a third of the model: 1 copy each
    L.measure_step(specs, [1], reps=1)
    assert all(len({c[3] for c in calls if c[0] == k and c[1] == s}) == 1 for k in here for s in specs)


def test_plan_times_the_step_then_the_rest(monkeypatch):
    """A plan times up to 64 rows as a step and past that one shape at a time; a candidate dropped as hopeless in
    the step is not timed at the larger buckets."""
    L, calls = _count_calls(monkeypatch, slow=lambda kern, rows: kern == "torch")
    plan = L.measure_plan({(48, 32): LinearSpec(2, 256)}, reps=1)
    times = plan.times[(48, 32)]
    assert sorted(times["torch"]) == [1, 2, 3, 4, 8, 16]
    assert any(sorted(t) == [1, 2, 3, 4, 8, 16, 32, 64, 128, 192, 256] for t in times.values())
    assert not [c for c in calls if c[0] == "torch" and c[2] > 16]
    assert {k for _, k in plan.choices[(48, 32)]} <= set(times) - {"torch"}


@pytest.mark.parametrize("wrong_at", [3, 97])
def test_plan_leaves_out_a_kernel_that_answers_wrong(monkeypatch, caplog, wrong_at):
    """The warm-up's answers are checked against the fp32 product: a candidate wrong at one count of rows (3: a
    bucket of the step; 97: the uneven count timed inside the 128 bucket) is left out of that shape's plan at
    every bucket, with a warning, and is not timed again; the other shape keeps it, and the other candidates stay."""
    import minisgl.linear as L
    here = [k for k in KERNELS if kernel_runs(k, 1, 64)]
    bad = next((k for k in here if k != "torch" and kernel_runs(k, 128, 64)), "torch")   # ours where the extension runs
    real, calls = L.run_linear, []
    def fake(kern, x, w, n, *a, **kw):
        y = real(kern, x, w, n, *a, **kw)
        calls.append((kern, n, x.shape[0]))
        if kern == bad and n == 48 and x.shape[0] == wrong_at: y[-1, :8] += 1.0   # 8 outputs of the last row
        return y
    monkeypatch.setattr(L, "run_linear", fake)
    specs = {(48, 64): LinearSpec(2, 128), (32, 64): LinearSpec(1, 128)}
    with caplog.at_level(logging.WARNING, logger="minisgl.linear"):
        plan = L.measure_plan(specs, reps=1)
    assert f"{bad} computes 48 x 64 at {wrong_at} rows wrong on this machine (8 of {wrong_at * 48} outputs" in caplog.text
    assert bad not in plan.times[(48, 64)] and bad not in {k for _, k in plan.choices[(48, 64)]}
    assert set(plan.times[(48, 64)]) == set(plan.times[(32, 64)]) - {bad}
    assert bad in plan.times[(32, 64)]
    late = [c[2] for c in calls if c[0] == bad and c[1] == 48 and c[2] >= wrong_at]   # only the warm-up of its bucket:
    assert sorted(set(late)) == sorted({wrong_at, 128 if wrong_at > 64 else wrong_at})   # 128 rows, then 97, 2 copies
    assert len(late) == 2 * len(set(late))
    assert caplog.text.count(" wrong on this machine ") == 1


def _fake_timers(monkeypatch, spikes):
    """Fake `measure_step` / `measure_linear` for one shape and two kernels: a smooth curve (flat to 64 rows, then
    linear), slowed 10x at the (kernel, rows) points in `spikes` while their count lasts. Records each call."""
    import minisgl.linear as L
    calls, left = [], dict(spikes)
    def curve(kern, m):
        t = (1.0 if kern == "tiles" else 1.2) * max(1.0, m / 64) * 1e-4
        if left.get((kern, m), 0) > 0:
            left[kern, m] -= 1
            return 10 * t
        return t
    def step(specs, rows, reps=5, wrong=None):
        calls.append(("step", list(rows), None))
        return {s: {k: {m: curve(k, m) for m in rows} for k in ("tiles", "onednn")} for s in specs}
    def linear(n, k, rows, copies=1, reps=5, kernels=None, wrong=None):
        calls.append(("linear", list(rows), sorted(kernels)))
        return {kern: {m: curve(kern, m) for m in rows} for kern in kernels}
    monkeypatch.setattr(L, "measure_step", step)
    monkeypatch.setattr(L, "measure_linear", linear)
    return L, calls


def test_plan_times_disturbed_points_again(monkeypatch, caplog):
    """A timing that breaks what a matmul's time does as rows grow (a busy moment: here 10x slower at one bucket
    of the step and one past it) is timed again, the way it was first timed, and the faster reading is kept."""
    L, calls = _fake_timers(monkeypatch, {("tiles", 32): 1, ("onednn", 192): 1})
    assert L.suspect_timings({"tiles": {16: 1e-4, 32: 1e-3, 64: 1e-4}}) == {("tiles", 32)}
    with caplog.at_level(logging.INFO, logger="minisgl.linear"):
        plan = L.measure_plan({(48, 32): LinearSpec(2, 256)}, reps=1)
    times = plan.times[(48, 32)]
    assert L.suspect_timings(times) == set()
    assert times["tiles"][32] == pytest.approx(1e-4) and times["onednn"][192] == pytest.approx(1.2e-4 * 3)
    assert calls == [("step", [1, 2, 3, 4, 8, 16, 32, 64], None), ("linear", [128, 192, 256], ["onednn", "tiles"]),
                     ("step", [32], None), ("linear", [192], ["onednn"])]
    assert "timing again the points that look disturbed: 2 (" in caplog.text and "still look disturbed" not in caplog.text
    assert [k for m, k in plan.choices[(48, 32)]] == ["tiles"] * 11


def test_plan_warns_of_points_that_stay_disturbed(monkeypatch, caplog):
    "A point slow at every reading is timed again `_RETIMES` times, then kept with a warning; the plan still comes."
    L, calls = _fake_timers(monkeypatch, {("onednn", 4): 99})
    with caplog.at_level(logging.INFO, logger="minisgl.linear"):
        plan = L.measure_plan({(48, 32): LinearSpec(2, 64)}, reps=1)
    assert [c for c in calls if c[1] == [4]] == [("step", [4], None)] * L._RETIMES
    assert L.suspect_timings(plan.times[(48, 32)]) == {("onednn", 4)}
    assert "still look disturbed after timing them again (was the machine busy?): 1 (48x32 onednn@4)" in caplog.text
    assert [k for m, k in plan.choices[(48, 32)]] == ["tiles"] * 8
