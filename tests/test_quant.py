"""The embedded GGUF served natively (`--quantization gguf`, chapter quant) against the same file dequantized.

Both engines run fp32 activations and KV, so the only difference is the native kernels' rounding of the
activations to int8 per block of 32 (chapter quant: at most dx / 2 an element). On the held prompts:
- the logits of every prompt's last token stay within LOGIT_BOUND of the dequantized model's, and their
  mean difference within MEAN_BOUND, with every linear on `q8dot`, the kernel that rounds the activations
  (the plan's others, `qamx` and `dequant`, compute the dequantized model's products: 0 difference). The
  logits span about -20..35; measured on the Intel Xeon: at most 1.37 and a mean of 0.59 (the 37-token
  chat prompt), 0.4-1.1 and 0.07-0.44 elsewhere; a wrong kernel is off by whole units everywhere;
- greedy tokens, through the scheduler with chunked prefill and the radix cache, equal the dequantized
  model's, or part on a near tie: the reference's top-2 gap at that step within TIE (twice LOGIT_BOUND,
  the most that two logits, each off by at most LOGIT_BOUND, can move their difference);
- the overlap loop gives the same tokens, no KV page leaks, and `minisgl serve --quantization gguf`
  answers a real OpenAI client; int8 weights (`--quantization int8`) decode the same prompts, near ties aside.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.messages import UserMsg
from minisgl.models import ForwardContext
from minisgl.quant import QuantLinear, quant_available
from minisgl.scheduler import Scheduler, SchedulerConfig
from test_engine_hf import make_prompts, one_thread, run_engine  # noqa: F401 (one_thread: the module's autouse fixture)

pytestmark = pytest.mark.skipif(not quant_available(), reason="minisgl._C built without the quantized linears")

NEW_TOKENS = 24
LOGIT_BOUND = 2.0
MEAN_BOUND = 0.75
TIE = 2 * LOGIT_BOUND
INT8_TIE = 4.0   # int8 re-quantizes the dequantized Q4_1 weights: their logits moved by up to 1.8 here


def make(quantization):
    # quantized: q8dot at every size, the kernel these tests bound (a measured plan may pick dequant for some sizes,
    # and timings vary); the plan's measurement is chapter quant's and test_auto_measures_...'s
    return Engine(EngineConfig(model=None, dtype="float32", device="cpu", page_size=4, num_pages=1200, max_seq_len=1024,
                               quantization=quantization, kernels="auto" if quantization == "none" else "q8dot"),
                  progress=False)


@pytest.fixture(scope="module")
def native(one_thread):
    e = make("gguf")
    assert all(lin.kernels == ["q8dot"] * len(lin.kernels) for lin in e.model.modules() if isinstance(lin, QuantLinear))
    return e


@pytest.fixture(scope="module")
def dequantized(one_thread): return make("none")


def last_logits(engine, prompt):
    "The logits of `prompt`'s last token, one prefill through the engine's model and KV pool."
    n = len(prompt)
    slots = torch.arange(n)
    ctx = ForwardContext(True, slots, slots.view(1, -1), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]),
                         engine.kv_caches, engine.backend)
    with torch.inference_mode():
        return engine.model(torch.tensor(prompt), torch.arange(n), ctx, torch.tensor([n - 1]))[0]


def test_native_model_holds_the_file_as_stored(native):
    lins = [m for m in native.model.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 4 * 30 + 1                                        # every projection, and the tied LM head
    assert {f.name for m in lins for f in m.formats} == {"Q4_1", "Q8_0"}
    held = {t.data_ptr(): t.nbytes for t in list(native.model.parameters()) + list(native.model.buffers())}
    from minisgl.weights import default_gguf_path
    rotary = native.model.rotary.cos.nbytes + native.model.rotary.sin.nbytes   # tables, not weights
    assert sum(held.values()) - rotary <= 1.1 * default_gguf_path().stat().st_size


def test_logits_within_the_bound(native, dequantized):
    worst = mean = 0.0
    for p in make_prompts(native.tokenizer):
        d = (last_logits(native, p) - last_logits(dequantized, p)).abs()
        worst, mean = max(worst, d.max().item()), max(mean, d.mean().item())
    print(f"logit difference, native vs dequantized: largest {worst:.3f} (bound {LOGIT_BOUND}), "
          f"largest mean {mean:.3f} (bound {MEAN_BOUND})")
    assert worst <= LOGIT_BOUND and mean <= MEAN_BOUND


def check_same_or_tie(ours, ref, ref_engine, prompt, what, tie=TIE):
    assert len(ours) == len(ref) == NEW_TOKENS, what
    for j, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = last_logits(ref_engine, prompt + ref[:j]).topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= tie, f"{what}: token {j} differs ({a} vs {b}) and the top-2 gap {gap:.3f} > {tie}: not a near tie"
            print(f"{what}: parted at token {j} on a near tie (gap {gap:.2f})")
            return


def test_greedy_tokens_match_through_the_scheduler(native, dequantized):
    prompts = make_prompts(native.tokenizer)
    cfg = SchedulerConfig(max_running_reqs=8, prefill_budget=48, cache="radix")   # chunked prefill, prefix hits
    sched, ours = run_engine(native, prompts + prompts[1:3], cfg, max_tokens=NEW_TOKENS)
    _, ref = run_engine(dequantized, prompts, SchedulerConfig(max_running_reqs=8, prefill_budget=512, cache="naive"),
                        max_tokens=NEW_TOKENS)
    for i, p in enumerate(prompts):
        check_same_or_tie(ours[i], ref[i], dequantized, p, f"prompt {i} ({len(p)} tokens)")
    assert ours[len(prompts):] == ours[1:3]                                  # again, from the radix cache


def test_overlap_loop_gives_the_same_tokens(native):
    prompts = make_prompts(native.tokenizer)[4:8]
    outs = []
    for overlap in (False, True):
        sched = Scheduler(native, SchedulerConfig(max_running_reqs=8, prefill_budget=32, overlap=overlap))
        for i, p in enumerate(prompts):
            sched.submit(UserMsg(i, p, SamplingParams(max_tokens=8, ignore_eos=True)))
        res = sched.run_until_idle()
        sched.check_integrity()
        sched.close()
        outs.append([[o.token_id for o in res[i] if o.token_id is not None] for i in range(len(prompts))])
    assert outs[0] == outs[1]


def requantized_file(path, formats):
    "The embedded GGUF with the linears named in `formats` (e.g. 'ffn_up') requantized by gguf-py to their format, the rest as stored."
    import gguf
    from minisgl.weights import default_gguf_path
    reader = gguf.GGUFReader(default_gguf_path())
    writer = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():   # the metadata as it is (gguf-py's gguf_new_metadata does the same)
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."): continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    data = []
    for t in reader.tensors:
        qtype, d = t.tensor_type, t.data
        if (fmt := formats.get(t.name.split(".")[-2])) is not None:
            qtype, d = fmt, gguf.quants.quantize(gguf.quants.dequantize(t.data, t.tensor_type), fmt)
        writer.add_tensor_info(t.name, d.shape, d.dtype, d.nbytes, raw_dtype=qtype)
        data.append(d)
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_ti_data_to_file()
    for d in data: writer.write_tensor_data(d)
    writer.close()


def dense_copy(engine):
    "`engine` with its quantized linears swapped for fp32 `nn.Linear`s of their exact dequantization."
    for name, lin in list(engine.model.named_modules()):
        if not isinstance(lin, QuantLinear): continue
        dense = torch.nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
        dense.weight.data = lin.dequantized()
        if lin.bias is not None: dense.bias.data = lin.bias.float()
        parent, _, attr = name.rpartition(".")
        setattr(engine.model.get_submodule(parent), attr, dense.requires_grad_(False))
    engine.model.__dict__.pop("_native_args", None)   # the fused decode step's view of the weights, taken anew
    assert not any(isinstance(m, QuantLinear) for m in engine.model.modules())
    return engine


def test_q5_file_decodes_like_its_dequantized_model(tmp_path, monkeypatch):
    # Q5_0 is what llama.cpp's K-quant files hold where rows are not a multiple of 256 (this model's 576: a Q4_K_M of
    # it has 166 Q5_0 linears), Q5_1 its sibling: a file of both, served natively against the same file dequantized.
    # The reference is the file's exact dequantization (bit-exact with gguf-py, chapter quant) in plain fp32 linears,
    # rather than transformers' reading of it, which the Q4_1 tests above already hold the loader to (and which
    # would cost a 30 s conversion)
    from gguf import GGMLQuantizationType as Q
    path = tmp_path / "smollm2-q5.gguf"
    requantized_file(path, {"attn_q": Q.Q5_0, "attn_k": Q.Q5_0, "attn_output": Q.Q5_0, "ffn_gate": Q.Q5_0,
                            "ffn_up": Q.Q5_0, "attn_v": Q.Q5_1, "ffn_down": Q.Q5_1})
    kw = dict(model=str(path), dtype="float32", device="cpu", page_size=4, num_pages=600, max_seq_len=512)
    monkeypatch.setenv("MINISGL_CACHE", str(tmp_path / "cache"))      # converted here, whatever a cache holds
    native = Engine(EngineConfig(**kw, kernels="q8dot"), progress=False)
    dequantized = dense_copy(Engine(EngineConfig(**kw, kernels="q8dot"), progress=False))
    lins = [m for m in native.model.modules() if isinstance(m, QuantLinear)]
    assert len(lins) == 4 * 30 + 1 and {f.name for m in lins for f in m.formats} == {"Q5_0", "Q5_1", "Q8_0"}
    from minisgl.weights import converted_dir
    assert native.model_dir == converted_dir(path)                        # its conversion: the config half only
    assert not list(native.model_dir.glob("*.safetensors"))
    prompts = make_prompts(native.tokenizer)[:6]
    worst = max((last_logits(native, p) - last_logits(dequantized, p)).abs().max().item() for p in prompts)
    print(f"Q5_0/Q5_1 file: largest logit difference, native vs dequantized, {worst:.3f} (bound {LOGIT_BOUND})")
    assert worst <= LOGIT_BOUND
    cfg = SchedulerConfig(max_running_reqs=8, prefill_budget=48, cache="radix")
    _, ours = run_engine(native, prompts, cfg, max_tokens=NEW_TOKENS)
    _, ref = run_engine(dequantized, prompts, cfg, max_tokens=NEW_TOKENS)
    for i, p in enumerate(prompts):
        check_same_or_tie(ours[i], ref[i], dequantized, p, f"Q5 prompt {i}")


def test_float_linears_are_read_from_the_file_unpermuted(tmp_path, caplog):
    """Linears the kernels do not take (here F16 q and k projections, which llama.cpp stores with their rows permuted)
    are de-quantized from the file itself, rows un-permuted: equal to transformers' reading of the Q4_1 originals
    within F16's rounding (a row out of place would be off by whole weights); the rest of the fused projection, the
    Q4_1 v rows, bit for bit."""
    import logging
    from gguf import GGMLQuantizationType as Q
    from minisgl.weights import load_gguf_model, load_model, resolve_model
    path = tmp_path / "smollm2-f16-qk.gguf"
    requantized_file(path, {"attn_q": Q.F16, "attn_k": Q.F16})
    d = resolve_model(None, progress=False)          # the embedded model's conversion: the same config, transformers' weights
    with caplog.at_level(logging.INFO, logger="minisgl.weights"):
        ours = load_gguf_model(d, path, torch.float32)
    assert "layers.7.self_attn.qkv_proj dequantized to float32 (F16 has no native kernel)" in caplog.text
    ref = load_model(d, torch.float32)
    cfg = ref.cfg
    for i in (0, 7, 29):
        a, b = ours.layers[i].self_attn.qkv_proj.weight, ref.layers[i].self_attn.qkv_proj.weight
        qk = cfg.q_size + cfg.kv_size
        assert torch.allclose(a[:qk], b[:qk], rtol=2 ** -10, atol=2 ** -24), i
        assert torch.equal(a[qk:], b[qk:]), i
        assert isinstance(ours.layers[i].mlp.gate_up_proj, QuantLinear)


def test_int8_weights_decode_like_the_dequantized_model(dequantized):
    int8 = make("int8")
    assert all(isinstance(m, QuantLinear) for m in (int8.model.layers[0].mlp.down_proj, int8.model.lm_head))
    prompts = make_prompts(int8.tokenizer)[4:7]
    cfg = SchedulerConfig(max_running_reqs=4, prefill_budget=512, cache="naive")
    _, ours = run_engine(int8, prompts, cfg, max_tokens=NEW_TOKENS)
    _, ref = run_engine(dequantized, prompts, cfg, max_tokens=NEW_TOKENS)
    for i, p in enumerate(prompts):
        check_same_or_tie(ours[i], ref[i], dequantized, p, f"int8 prompt {i}", INT8_TIE)


def test_quantization_option_is_checked():
    from minisgl.core import ParamError
    with pytest.raises(ParamError, match="quantization"):
        EngineConfig(quantization="q4")
    with pytest.raises(ParamError, match="one rank"):
        EngineConfig(quantization="gguf", tp_size=2)


def test_server_answers_on_the_native_path():
    from openai import OpenAI
    from server_utils import ServerProc
    s = ServerProc("--dtype", "float32", "--device", "cpu", "--num-pages", "256", "--max-seq-len", "512",
                   "--quantization", "gguf", "--num-threads", "1")
    try:
        client = OpenAI(base_url=s.base + "/v1", api_key="unused")
        reply = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is 2+2?"}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
        bad = client.with_options(max_retries=0).completions
        with pytest.raises(Exception, match="max_tokens"):
            bad.create(model="default", prompt="hi", max_tokens=-1)
        again = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is 2+2?"}],
                                               max_tokens=8, temperature=0)
        assert again.choices[0].message.content == reply.choices[0].message.content   # the bad one harmed nothing
    finally:
        s.kill()


def test_one_call_decode_step_equals_the_separate_calls():
    """bf16: the whole decode step in one C++ call (decode.cpp, quantized parts included) gives, to the bit, the logits of
    the same step as separate calls (`_decode_layers`: each C++ op and each QuantLinear called from Python), and the
    module path's within LOGIT_BOUND. Not the module path's to the bit: its norms and rotary are Python's, whose bf16
    rounding can differ from the C++ ops' in the last bit (seen: 3 elements of one row in layer 9), and an activation
    rounded to int8 per block can turn such a bit into a different q8."""
    import dataclasses
    e = Engine(EngineConfig(model=None, dtype="bfloat16", device="cpu", num_pages=64, max_seq_len=256,
                            quantization="gguf", kernels="q8dot"), progress=False)   # the kernels are set below
    m, n = e.model, 5
    slots = torch.arange(n)
    with torch.inference_mode():
        m(torch.tensor([1, 504, 3458, 2365, 7000]), slots, ForwardContext(
            True, slots, slots.view(1, -1), torch.tensor([0]), torch.tensor([n]), torch.tensor([n]), e.kv_caches, e.backend),
          torch.tensor([n - 1]))
        from minisgl.quant import quant_kernel_runs
        for kernel, rows in [("q8dot", 1), ("q8dot", 3)] + ([("qamx", 3)] if quant_kernel_runs("qamx", torch.bfloat16) else []):
            for lin in m.modules():   # this kernel whatever the plan picked (a CPU without VNNI may prefer another)
                if isinstance(lin, QuantLinear): lin.set_plan([(2048, kernel)])
            m.__dict__.pop("_native_args", None)
            d = ForwardContext(False, torch.arange(n, n + rows), torch.arange(n + 3).repeat(rows, 1),
                               torch.arange(rows) * 0, torch.full((rows,), n + 1), torch.ones(rows, dtype=torch.long),
                               e.kv_caches, e.backend)
            ids, pos = torch.tensor([42, 7, 99][:rows]), torch.full((rows,), n)
            fused = m(ids, pos, d)
            assert m.last_path == "fused decode"
            modules = m(ids, pos, dataclasses.replace(d, fused=False))
            dc = dataclasses.replace(d, fused=True, positions=pos)
            x, residual = m._decode_layers(m._embed(ids, dc), dc)
            separate = m.lm_head(m.norm(x, residual, fused=True)[0]).float()
            assert torch.equal(fused, separate), (kernel, rows)
            assert (fused - modules).abs().max() <= LOGIT_BOUND, (kernel, rows)


def test_auto_measures_native_against_dequantized_once(tmp_path, caplog, monkeypatch):
    """`quantization='auto'` on the embedded .gguf: decode steps of 1, 8 and 32 rows timed on an engine built each way,
    the faster by the geometric mean kept (the engine's quantization is the choice's), the figures saved in the plan cache
    and read back by the next engine; an HF directory, a forced dense kernel or tensor parallelism stay `none`."""
    import json
    import logging
    from minisgl.engine import CHOICE_ROWS, _choice_file, _resolve_quantization
    cfg = EngineConfig(model=None, dtype="bfloat16", device="cpu", num_pages=64, max_seq_len=256)
    path = _choice_file(cfg, torch.bfloat16)
    path.unlink(missing_ok=True)   # measured here, whatever ran before (the kernel plans stay cached)
    with caplog.at_level(logging.INFO, logger="minisgl.engine"):
        first = Engine(cfg, progress=False)
    choice = first.quantization_choice
    assert choice.source == "measured" and "measuring once whether" in caplog.text
    assert set(choice.native) == set(choice.dequantized) == set(CHOICE_ROWS)
    assert all(0 < s < 10 for s in [*choice.native.values(), *choice.dequantized.values()])
    assert first.quantization == choice.quantization == ("gguf" if choice.ratio <= 1 else "none")
    assert any(isinstance(m, QuantLinear) for m in first.model.modules()) == (first.quantization == "gguf")
    saved = json.loads(path.read_text())
    assert {int(m): s for m, s in saved["native"].items()} == choice.native
    second = Engine(cfg, progress=False)
    assert second.quantization_choice.source == f"cache {path}" and second.quantization == first.quantization
    import minisgl.engine as engine_mod
    from minisgl.engine import QuantChoice, quantization_choice
    remeasured = QuantChoice({1: 2.0}, {1: 1.0})
    monkeypatch.setattr(engine_mod, "measure_quantization", lambda config: remeasured)
    path.write_text("{not json")   # a damaged file is measured again, not trusted, and replaced
    assert quantization_choice(cfg, torch.bfloat16) is remeasured and quantization_choice(cfg, torch.bfloat16).native == {1: 2.0}
    assert quantization_choice(cfg, torch.bfloat16).quantization == "none"
    import threading, time
    calls = []
    def slow(config):
        calls.append(1); time.sleep(0.5); return QuantChoice({1: 1.0}, {1: 2.0})
    monkeypatch.setattr(engine_mod, "measure_quantization", slow)
    path.unlink()
    got = []
    threads = [threading.Thread(target=lambda: got.append(quantization_choice(cfg, torch.bfloat16))) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert len(calls) == 1 and [c.quantization for c in got] == ["gguf", "gguf"]   # started together, measured once
    path.unlink()   # the stub's figures are not this machine's
    dev = torch.device("cpu")
    assert _resolve_quantization(EngineConfig(kernels="gemv"), dev) == "none"
    assert _resolve_quantization(EngineConfig(tp_size=2), dev) == "none"
    assert _resolve_quantization(EngineConfig(model=str(tmp_path)), dev) == "none"
    assert _resolve_quantization(EngineConfig(), torch.device("cuda")) == "none"
    assert _resolve_quantization(EngineConfig(), dev) == "auto"


_BODY_SCRIPT = r"""
import sys, torch
from minisgl.quant import QUANT_FORMATS, native, random_gguf_rows, repack, quantize_int8
torch.manual_seed(0)
out = {'isa': native().quant_q8dot_isa()}
for name, fmt in QUANT_FORMATS.items():
    k = 512
    w = quantize_int8(torch.randn(48, k)) if name == 'I8' else torch.from_numpy(repack(fmt, random_gguf_rows(fmt, 48, k), k))
    x = torch.randn(11, k)
    b = torch.randn(48)   # 11 rows run in passes of 4, 4 and 3 rows of x; 1 and 2 rows in one pass of both halves
    out[name] = [native().quant_linear(x[:m].to(dt), [w], [fmt.qtype], b, 1).float() for dt in (torch.float32, torch.bfloat16)
                 for m in (11, 2, 1)]
torch.save(out, sys.argv[1])
"""


def test_avx2_body_gives_the_vnni_bodys_bits(tmp_path):
    "The int8 kernel's AVX2 body (MINISGL_CPU_ISA=avx2) against this CPU's own: the same bits for every format (the signed ones too: the sign trick there, the offset taken off in integers with VNNI)."
    import subprocess, sys
    from minisgl.quant import q8dot_isa
    if not q8dot_isa(): pytest.skip("no x86 vector unit: only the portable path runs here")
    runs = {}
    for cap in ("", "avx2"):
        path = tmp_path / f"out{cap}.pt"
        env = {**os.environ, "MINISGL_CPU_ISA": cap} if cap else {k: v for k, v in os.environ.items() if k != "MINISGL_CPU_ISA"}
        subprocess.run([sys.executable, "-c", _BODY_SCRIPT, str(path)], env=env, check=True, timeout=300)
        runs[cap] = torch.load(path)
    wide, avx2 = runs[""], runs["avx2"]
    assert avx2["isa"] == "avx2" and wide["isa"] == q8dot_isa()
    for name in wide:
        if name == "isa": continue
        for a, b in zip(wide[name], avx2[name]): assert torch.equal(a, b), name


def test_quant_plan_checks_each_kernels_answers(tmp_path, monkeypatch, caplog):
    """A measured quantized plan checks each kernel's warm-up answer against what that kernel is meant to compute
    (`QuantLinear.expected`): every kernel that runs here passes, for every format, with and without a bias, fp32 and
    bf16 activations, 1 to 64 rows; `q8dot` made wrong at one bucket of one shape is left out of that shape's plan at
    every bucket (with a warning) and kept for the others."""
    import logging
    import torch.nn as nn
    import minisgl.quant as Q
    monkeypatch.setenv("MINISGL_CACHE", str(tmp_path))
    monkeypatch.setattr(Q, "_QUANT_SAMPLE_S", 1e-4)        # the timings do not matter here, the checks do
    names = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "I8"]
    lins = []
    for i, name in enumerate(names):                          # one shape per format: 16 * (i + 1) x 256
        fmt, n = Q.QUANT_FORMATS[name], 16 * (i + 1)
        w = (Q.quantize_int8(torch.randn(n, 256)) if name == "I8"
             else torch.from_numpy(Q.repack(fmt, Q.random_gguf_rows(fmt, n, 256, seed=i), 256)))
        lins.append(QuantLinear(256, [(fmt, w)], torch.randn(n) if i % 2 else None))
    model = nn.Sequential(*lins)
    specs = {(lin.out_features, 256): Q.LinearSpec(1, 64) for lin in lins}
    for dtype in (torch.float32, torch.bfloat16):
        with caplog.at_level(logging.WARNING, logger="minisgl.linear"):
            plan = Q.quant_plan(model, specs, dtype, "measure")
        runs = {k for k in Q.QUANT_KERNELS if Q.quant_kernel_runs(k, dtype)}
        assert all(set(plan.times[s]) == runs for s in specs) and "wrong" not in caplog.text, caplog.text
    real = QuantLinear.run
    def q8dot_wrong_at_8(self, kernel, x2):
        y = real(self, kernel, x2)
        if kernel == "q8dot" and self.out_features == 48 and x2.shape[0] == 8: y[3, 5] += 100
        return y
    monkeypatch.setattr(QuantLinear, "run", q8dot_wrong_at_8)
    with caplog.at_level(logging.WARNING, logger="minisgl.linear"):
        plan = Q.quant_plan(model, specs, torch.float32, "measure")
    assert "q8dot computes 48 x 256 (Q5_0) at 8 rows wrong on this machine (1 of 384 outputs" in caplog.text
    assert "q8dot" not in plan.times[(48, 256)] and {k for _, k in plan.choices[(48, 256)]} == {"dequant"}
    assert all("q8dot" in plan.times[s] for s in specs if s != (48, 256))
    assert lins[2].kernels == ["dequant"] * len(lins[2].kernels)
