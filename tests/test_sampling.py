"""Statistical and exact tests of minisgl.sampling: allowed sets, distributions, seeds, penalties, logprobs."""
import math

import pytest
import torch

from minisgl.core import SamplingParams
from minisgl.sampling import SamplingBatch, apply_penalties, hash_uniform, row_keys, sample

V = 300


def draw(logits, params, steps, start=0):
    "Tokens [steps, B] for `steps` consecutive counters (each step a fresh SamplingBatch, like the engine)."
    out = []
    for s in range(start, start + steps):
        sb = SamplingBatch.from_params(params, logits.shape[1])
        out.append(sample(logits, sb, torch.full((logits.shape[0],), s)).tokens)
    return torch.stack(out)


def allowed(logits_row, p: SamplingParams):
    "The set of tokens a request may pick, computed the slow, obvious way."
    probs = torch.softmax(logits_row.double() / p.temperature, -1)
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for rank, t in enumerate(order):
        if p.top_k > 0 and rank >= p.top_k: break
        if mass >= p.top_p: break
        keep.append(t); mass += probs[t].item()
    return {t for t in keep if probs[t] >= p.min_p * probs.max()}


CASES = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.5),
         SamplingParams(temperature=1.3, min_p=0.2), SamplingParams(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05),
         SamplingParams(temperature=2.0, top_p=0.3), SamplingParams(temperature=1.0, top_k=1)]


def test_never_outside_the_allowed_set():
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), V) * 3
    picks = draw(logits, CASES, 400)
    for b, p in enumerate(CASES):
        ok = allowed(logits[b], p)
        got = set(picks[:, b].tolist())
        assert got <= ok, f"{p}: picked {sorted(got - ok)} outside {sorted(ok)}"
        if len(ok) > 1: assert len(got) > 1, f"{p}: never explored the allowed set"


def test_frequencies_follow_the_truncated_distribution():
    "Chi-square test of 4000 draws against the renormalized allowed probabilities."
    torch.manual_seed(1)
    logits = torch.randn(1, 40) * 1.5
    p = SamplingParams(temperature=0.8, top_k=8, top_p=0.9)
    ok = sorted(allowed(logits[0], p))
    probs = torch.softmax(logits[0].double() / p.temperature, -1)[ok]
    probs /= probs.sum()
    n = 4000
    logits_b = logits.repeat(n, 1)       # 4000 rows with 4000 different seeds in one call
    sb = SamplingBatch.from_params([p] * n, 40)
    picks = sample(logits_b, sb, torch.zeros(n)).tokens
    counts = torch.tensor([(picks == t).sum().item() for t in ok], dtype=torch.float64)
    assert counts.sum() == n
    chi2 = (((counts - n * probs) ** 2) / (n * probs)).sum().item()
    dof = len(ok) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), f"chi2 {chi2:.1f} for {dof} dof"


def test_seed_reproduces_alone_and_batched():
    torch.manual_seed(2)
    logits = torch.randn(6, V)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99)
    alone = draw(logits[:1], [seeded], 30)[:, 0]
    for pos in (0, 3, 5):   # the seeded request at different rows among unseeded and greedy ones
        params = [SamplingParams(temperature=1.0)] * 6
        params[1] = SamplingParams()
        params[pos] = seeded
        lg = logits.clone(); lg[pos] = logits[0]
        torch.testing.assert_close(draw(lg, params, 30)[:, pos], alone)
    other = draw(logits[:1], [SamplingParams(temperature=1.0, top_p=0.9, seed=100)], 30)[:, 0]
    assert not torch.equal(alone, other)
    assert len(set(alone.tolist())) > 3          # the counter moves the noise from step to step


def test_unseeded_requests_follow_torch_manual_seed():
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=1.0)] * 3
    torch.manual_seed(5); a = draw(logits, params, 10)
    torch.manual_seed(5); b = draw(logits, params, 10)
    torch.testing.assert_close(a, b)


def test_hash_is_uniform_and_keyed():
    keys = row_keys(torch.tensor([1, 2]), torch.tensor([0, 0]))
    u = hash_uniform(keys, torch.arange(200_000))
    hist = torch.histc(u[0], bins=20, min=0, max=1)
    assert (hist - 10_000).abs().max() < 600
    assert abs(torch.corrcoef(u)[0, 1].item()) < 0.01


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    torch.manual_seed(3)
    logits = torch.randn(2, V)
    seqs = [torch.tensor([1, 5, 5, 9, 200]), torch.tensor([7, 7, 3])]
    sb = SamplingBatch.from_params([SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.8)], V)
    got = apply_penalties(logits, seqs, [2, 1], sb)
    for b, (s, r) in enumerate(zip(seqs, (1.3, 0.8))):
        want = RepetitionPenaltyLogitsProcessor(r)(s[None].long(), logits[b:b + 1].clone())
        torch.testing.assert_close(got[b:b + 1], want)


def test_presence_and_frequency_penalties_as_defined():
    torch.manual_seed(4)
    logits = torch.randn(1, V)
    seq = torch.tensor([10, 11, 12, 12, 12, 13, 10])   # prompt [10, 11]; output [12, 12, 12, 13, 10]
    sb = SamplingBatch.from_params([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], V)
    got = apply_penalties(logits, [seq], [2], sb)
    want = logits.clone()
    for tok, count in {12: 3, 13: 1, 10: 1}.items():
        want[0, tok] -= 0.5 + 0.25 * count
    torch.testing.assert_close(got, want)          # token 11 (prompt only) untouched


def test_penalties_change_the_greedy_choice_through_sample():
    logits = torch.zeros(1, 10); logits[0, 3] = 1.0; logits[0, 4] = 0.9
    seq = [torch.tensor([0, 3])]
    base = sample(logits, SamplingBatch.from_params([SamplingParams()], 10), torch.zeros(1), seq, [1]).tokens
    pen = sample(logits, SamplingBatch.from_params([SamplingParams(frequency_penalty=0.5)], 10), torch.zeros(1),
                 seq, [1]).tokens
    assert (base.item(), pen.item()) == (3, 4)
    with pytest.raises(ValueError, match="penalties"):
        sample(logits, SamplingBatch.from_params([SamplingParams(frequency_penalty=0.5)], 10), torch.zeros(1))


def test_logprobs_and_top_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(3, V)
    params = [SamplingParams(logprobs=True, top_logprobs=4), SamplingParams(temperature=1.0, seed=1, logprobs=True),
              SamplingParams()]
    out = sample(logits, SamplingBatch.from_params(params, V), torch.zeros(3))
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.tokens[:, None]).squeeze(1))
    ids, vals = out.top_logprobs
    assert ids.shape == (3, 4)
    torch.testing.assert_close(vals, lp.topk(4, -1).values)
    assert out.tokens[0] == logits[0].argmax()


def test_greedy_is_argmax_and_bad_shapes_fail():
    logits = torch.randn(4, V)
    out = sample(logits, SamplingBatch.from_params([SamplingParams()] * 4, V), torch.zeros(4))
    torch.testing.assert_close(out.tokens, logits.argmax(-1))
    with pytest.raises(ValueError, match="logits"):
        sample(logits[:2], SamplingBatch.from_params([SamplingParams()] * 4, V), torch.zeros(4))
