"""Batch limits fitted to the machine (chapter 08, `fit_limits`): the decode rows and the serving chunk are read off
the kernel plan's timings, change when the timings change, give way to what the user sets, fall back to fixed
values where nothing was measured, and reach the scheduler of `LLM` and of the server's worker (with the policy
each usage gets: prefill-first offline, mixed batches when serving)."""
import logging

import pytest
import torch

from minisgl.engine import FIXED_LIMITS, BatchLimits, Engine, EngineConfig, fit_limits, linear_seconds
from minisgl.linear import ROW_BUCKETS, KernelPlan, LinearSpec, can_pack_linears
from minisgl.scheduler import MIN_PROMPT_CHUNK

LAYER, HEAD = (576, 576), (1000, 576)
needs_plan = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.bfloat16),
                                reason="no kernel plan on this CPU (no bf16 matmul kernels)")


def plan_with(knee_rows: int, base: float = 1e-3) -> KernelPlan:
    "A plan whose linears cost `base` seconds up to `knee_rows` rows (memory-bound), then grow with the rows."
    times = {b: base * max(1, b / knee_rows) for b in ROW_BUCKETS}
    picks = [(ROW_BUCKETS[-1], "tiles")]
    return KernelPlan({LAYER: picks, HEAD: picks}, {LAYER: {"tiles": times}, HEAD: {"tiles": dict(times)}})


SPECS = {LAYER: LinearSpec(30, 2048), HEAD: LinearSpec(1, 256)}


@pytest.mark.parametrize("knee", [8, 32, 128])
def test_rows_follow_the_measured_knee(knee):
    "Where a step stops costing the same for more rows, the rows stop growing: the choice moves with the timings."
    limits = fit_limits(plan_with(knee), SPECS, HEAD)
    assert limits.max_running_reqs == knee
    assert limits.why.startswith("kernel plan")
    assert limits.prefill_budget == ROW_BUCKETS[-1]   # offline: the longest round measured


@pytest.mark.parametrize("base,chunk", [(1e-3, 32), (1e-4, 768), (2e-5, 2048), (2e-3, 16), (1e-2, 16)])
def test_serving_chunk_keeps_a_step_under_the_target(base, chunk):
    """A full mixed step (the 32 fitted decode rows + the largest prompt chunk, at least 16 tokens) whose matmuls fit
    100 ms: 30 layers of `base` seconds up to 32 rows, then in proportion; faster machines get longer chunks, a
    machine slower than the target still 16 prompt tokens per step. The budget counts both."""
    limits = fit_limits(plan_with(32, base), SPECS, HEAD, step_target=0.1)
    assert limits.max_running_reqs == 32
    assert limits.serve_budget == 32 + chunk
    assert fit_limits(plan_with(32, base), SPECS, HEAD, step_target=100.0).serve_budget == 32 + ROW_BUCKETS[-1]


def test_a_full_mixed_step_still_takes_prompt_tokens():
    "The mixed policy counts decode rows in its budget: the served budget leaves at least MIN_PROMPT_CHUNK for prompts."
    from minisgl.core import SamplingParams
    from minisgl.messages import UserMsg
    from minisgl.scheduler import Scheduler, SchedulerConfig, ToyEngine
    limits = fit_limits(plan_with(32, 1e-2), SPECS, HEAD)   # a slow machine: the minimum chunk
    rows = limits.max_running_reqs
    s = Scheduler(ToyEngine(num_pages=4096, page_size=4, max_seq_len=512),
                  SchedulerConfig(max_running_reqs=rows, prefill_budget=limits.serve_budget, schedule_policy="mixed",
                                  overlap=False))
    sp = SamplingParams(max_tokens=400, ignore_eos=True)
    for uid in range(rows - 1): s.submit(UserMsg(uid, [1 + uid % 31] * 8, sp))
    for _ in range(50):
        s.step()
        if s.stats()["running"] == rows - 1: break
    assert s.stats()["running"] == rows - 1   # every slot but one decoding
    s.submit(UserMsg(999, [1 + i % 31 for i in range(100)], sp))   # a prompt that arrives into the last slot
    s.step()
    late = [r for r in s.live_reqs() if r.uid == 999]
    assert late and late[0].device_len >= MIN_PROMPT_CHUNK   # its first chunk ran beside the 31 decode rows


def test_slack_and_bounds():
    plan = plan_with(4096)   # batching is free everywhere: the largest allowed rows
    assert fit_limits(plan, SPECS, HEAD).max_running_reqs == 256
    assert fit_limits(plan, SPECS, HEAD, max_rows=64).max_running_reqs == 64
    # a plan with missing timings, or no specs at all, measures nothing
    assert fit_limits(KernelPlan(plan.choices), SPECS, HEAD) == FIXED_LIMITS
    assert fit_limits(plan, {}, HEAD) == FIXED_LIMITS


def test_linear_seconds_buckets():
    plan = plan_with(32)
    assert linear_seconds(plan, LAYER, 5) == linear_seconds(plan, LAYER, 8)       # the next bucket up
    assert linear_seconds(plan, LAYER, 4096) == pytest.approx(2 * linear_seconds(plan, LAYER, 2048))


def test_pool_caps_fitted_rows_only():
    fitted = fit_limits(plan_with(128), SPECS, HEAD)
    assert fitted.capped(10 * 256).max_running_reqs == 10
    assert fitted.capped(10 ** 6) == fitted
    assert BatchLimits(64, 512, 128, "max_running_reqs configured").capped(256).max_running_reqs == 64
    assert FIXED_LIMITS.capped(256) == FIXED_LIMITS


@needs_plan
def test_engine_fits_its_limits_and_logs_them(caplog):
    with caplog.at_level(logging.INFO, logger="minisgl.engine"):
        eng = Engine(EngineConfig(dtype="bfloat16", device="cpu", max_seq_len=512), progress=False)
    lim = eng.limits
    head = (eng.model.lm_head.out_features, eng.model.lm_head.in_features)
    want = fit_limits(eng.kernel_plan, eng.linear_specs, head).capped(eng.num_pages * eng.page_size)
    assert lim == want and lim.why.startswith("kernel plan")
    assert lim.max_running_reqs in ROW_BUCKETS and 8 <= lim.max_running_reqs <= 256
    assert lim.prefill_budget == ROW_BUCKETS[-1] and lim.serve_budget - lim.max_running_reqs in ROW_BUCKETS and lim.serve_budget - lim.max_running_reqs >= MIN_PROMPT_CHUNK
    assert any("batch limits" in r.getMessage() for r in caplog.records)
    # the pool is sized for the fitted rows: every one of them (and one more) can fill a whole context
    assert eng.num_pages <= (lim.max_running_reqs + 1) * 512 // eng.page_size
    # a configured row count wins, the budget stays fitted
    eng2 = Engine(EngineConfig(dtype="bfloat16", device="cpu", max_seq_len=512, max_running_reqs=3), progress=False)
    assert eng2.limits.max_running_reqs == 3 and eng2.limits.serve_budget == lim.serve_budget
    assert eng2.num_pages == 4 * 512 // eng2.page_size


@needs_plan
def test_llm_scheduler_uses_the_fitted_limits():
    from minisgl.llm import LLM
    llm = LLM(dtype="bfloat16", max_seq_len=512)
    assert llm.scheduler.config.max_running_reqs == llm.engine.limits.max_running_reqs
    assert llm.scheduler.config.prefill_budget == llm.engine.limits.prefill_budget
    assert llm.scheduler.config.schedule_policy == "prefill_first"
    serving = llm.args.scheduler_config(llm.engine, serving=True)   # what the server's worker builds
    assert (serving.prefill_budget, serving.schedule_policy) == (llm.engine.limits.serve_budget, "mixed")
    from minisgl.core import SamplingParams
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    llm2 = LLM(dtype="bfloat16", max_seq_len=512, max_running_reqs=5, prefill_budget=300)
    assert (llm2.scheduler.config.max_running_reqs, llm2.scheduler.config.prefill_budget) == (5, 300)


def test_fp32_engine_keeps_the_fixed_limits(tmp_path):
    "No kernel plan (fp32): the fixed values, which the pool does not cap."
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
                     ).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
                            ).save_pretrained(tmp_path)
    eng = Engine(EngineConfig(model=str(tmp_path), dtype="float32", device="cpu", num_pages=8, page_size=4),
                 progress=False)
    assert eng.kernel_plan is None and eng.limits == FIXED_LIMITS
