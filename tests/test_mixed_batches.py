"""Mixed batches on the real default model: running requests' decode tokens and prompt chunks in one forward.
In fp32 every request's greedy tokens equal its solo run, the KV pool is whole afterwards, and a mixed round
really mixed (decode rows beside prompt chunks); in bf16 (the engine's fused paths and kernel plan) the two
policies agree up to near ties. Natively (quantized weights on `q8dot`), every request's tokens and log-probabilities
are the same bits as its solo run, in fp32 and bf16, whatever shares its steps."""
import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.engine import Engine, EngineConfig
from minisgl.messages import UserMsg
from minisgl.scheduler import Scheduler, SchedulerConfig

TEXT = ("The history of computing is a story of people trying to make machines do arithmetic faster. "
        "Early mechanical calculators used gears and levers; later, relays and vacuum tubes replaced them. ") * 4


@pytest.fixture(scope="module")
def engines():
    kw = dict(device="cpu", max_running_reqs=4, max_seq_len=256, quantization="none")   # the dense paths
    return {dt: Engine(EngineConfig(dtype=dt, **kw), progress=False) for dt in ("float32", "bfloat16")}


def run(eng, policy, prompts, max_tokens=10, stagger=True, top=False):
    sched = Scheduler(eng, SchedulerConfig(max_running_reqs=4, prefill_budget=24, schedule_policy=policy))
    kinds, forward = [], eng.forward_batch
    def spy(batch):
        kinds.append({r.cached_len >= r.prompt_len for r in batch.reqs})   # {True}: decode only, {False}: prompts only
        return forward(batch)
    eng.forward_batch = spy
    try:
        res = {}
        for i, p in enumerate(prompts):
            sched.submit(UserMsg(i, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=top, top_logprobs=3 if top else 0)))
            if stagger:
                for _ in range(3):
                    for o in sched.step(): res.setdefault(o.uid, []).append(o)
        for uid, outs in sched.run_until_idle().items(): res.setdefault(uid, []).extend(outs)
        sched.check_integrity()
        cm = sched.cache_manager
        assert cm.num_owned_pages == 0 and cm.num_free_pages + cm.num_cached_pages == cm.num_pages
    finally:
        eng.forward_batch = forward
        sched.close()
    if top: return {uid: [(o.token_id, o.top_logprobs) for o in outs if o.token_id is not None] for uid, outs in res.items()}, kinds
    return {uid: [o.token_id for o in outs if o.token_id is not None] for uid, outs in res.items()}, kinds


def prompts_of(eng):
    ids = eng.tokenizer(TEXT)["input_ids"]
    return [ids[5 * i: 5 * i + n] for i, n in enumerate((30, 7, 50, 12))]


def test_fp32_mixed_equals_solo(engines):
    eng = engines["float32"]
    prompts = prompts_of(eng)
    got, kinds = run(eng, "mixed", prompts)
    assert any(k == {True, False} for k in kinds), "no round mixed decode rows with prompt chunks"
    for i, p in enumerate(prompts):
        alone, _ = run(eng, "prefill_first", [p], stagger=False)
        assert got[i] == alone[0], (i, got[i], alone[0])


def test_bf16_policies_agree(engines):
    eng = engines["bfloat16"]
    prompts = prompts_of(eng)
    mixed, _ = run(eng, "mixed", prompts, top=True)
    first, kinds = run(eng, "prefill_first", prompts, top=True)
    assert all(len(k) == 1 for k in kinds)   # prefill-first never mixes
    # bf16 kernels round differently per batch shape: the same tokens up to the first near tie, where each
    # run's pick must be the other's runner-up within 0.3 in log-probability: a bf16 logit between 16 and 32 moves
    # in steps of 0.125, and a gap of two such steps (each logit rounded once the other way) was seen
    for i in mixed:
        a, b = mixed[i], first[i]
        assert len(a) == len(b) == 10
        diff = next((j for j, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        if diff is None: continue
        near_a, near_b = dict(map(tuple, a[diff][1])), dict(map(tuple, b[diff][1]))
        assert b[diff][0] in near_a and near_a[a[diff][0]] - near_a[b[diff][0]] < 0.3, (i, diff, a[diff], b[diff])
        assert a[diff][0] in near_b and near_b[b[diff][0]] - near_b[a[diff][0]] < 0.3, (i, diff, a[diff], b[diff])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_request_is_the_same_bits_beside_any_others(dtype):
    # Quantized activations turn any rounding difference into a step of an int8 (0.05 in a log-probability), so
    # natively a request is served the same bits whatever its neighbours: q8dot computes each row alone, and the
    # attention kernels cut a request's keys the same way in any batch and take a single new query through the
    # decode body in a mixed step too. A prompt past 1024 tokens: decode attention's key chunks (512+) are merged.
    eng = Engine(EngineConfig(dtype=dtype, device="cpu", max_running_reqs=4, max_seq_len=1200, kernels="q8dot"), progress=False)
    assert eng.quantization == "gguf"
    ids = eng.tokenizer(TEXT * 9)["input_ids"]
    prompts = [ids[7 * i: 7 * i + n] for i, n in enumerate((300, 9, 1100, 520))]
    assert [len(p) for p in prompts] == [300, 9, 1100, 520]
    alone = [run(eng, "prefill_first", [p], stagger=False, top=True, max_tokens=8)[0][0] for p in prompts]
    for policy in ("mixed", "prefill_first"):
        got, kinds = run(eng, policy, prompts, top=True, max_tokens=8)
        assert policy != "mixed" or any(k == {True, False} for k in kinds), "no round mixed decode rows with prompt chunks"
        for i in range(len(prompts)):
            assert got[i] == alone[i], (policy, i, got[i], alone[i])
