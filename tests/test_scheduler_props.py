"""Property tests of the scheduler (normal and overlap loops, prefill-first and mixed batches) driven by `ToyEngine`.

Random arrivals, prompts with shared prefixes, output lengths, page sizes, small KV pools, chunk
budgets, stop conditions and aborts. After every round: the integrity invariant. At the end:
no starvation, every request ends exactly once with its tokens equal to a solo run, and an idle
engine has free + cached = total pages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minisgl.core import SamplingParams
from minisgl.messages import AbortMsg, UserMsg
from minisgl.scheduler import Scheduler, SchedulerConfig, ToyEngine

MAX_SEQ_LEN = 24
PREFIXES = [(), (3, 1, 4, 1), (3, 1, 4, 1, 5, 9, 2, 6), (2, 7, 1, 8, 2, 8)]


@dataclass(frozen=True)
class Arrival:
    uid: int
    round: int
    prompt: tuple[int, ...]
    params: SamplingParams
    abort_round: int | None


@dataclass(frozen=True)
class Scenario:
    page_size: int
    num_pages: int
    vocab_size: int
    eos: tuple[int, ...]
    config: SchedulerConfig
    arrivals: tuple[Arrival, ...]

    def engine(self, slow: bool = False) -> ToyEngine:
        return (SlowToyEngine if slow else ToyEngine)(
            num_pages=self.num_pages, page_size=self.page_size, max_seq_len=MAX_SEQ_LEN,
            vocab_size=self.vocab_size, eos_token_ids=list(self.eos))


class SlowToyEngine(ToyEngine):
    "Starts each forward a moment late, so that in the overlap loop the scheduler really acts while a round is in flight."
    def forward_batch(self, batch):
        time.sleep(0.001)
        return super().forward_batch(batch)


@st.composite
def scenarios(draw, overlap: bool, policy: str = 'prefill_first') -> Scenario:
    page_size = draw(st.sampled_from([1, 2, 4]))
    vocab = draw(st.integers(6, 16))
    arrivals = []
    for uid in range(draw(st.integers(1, 7))):
        prefix = draw(st.sampled_from(PREFIXES))
        suffix = draw(st.lists(st.integers(0, 9), min_size=0 if prefix else 1, max_size=6))
        prompt = tuple(t % vocab for t in prefix + tuple(suffix))
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 8)),
            ignore_eos=draw(st.booleans()),
            stop=draw(st.lists(st.text(alphabet='abcdefgh', min_size=1, max_size=2), max_size=1)),
            stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=1)))
        arrive = draw(st.sampled_from([0, 0, 1, 2, 4, 8]))
        abort = draw(st.one_of(st.none(), st.integers(arrive, arrive + 10))) if draw(st.integers(0, 4)) == 0 else None
        arrivals.append(Arrival(uid, arrive, prompt, params, abort))
    config = SchedulerConfig(max_running_reqs=draw(st.integers(1, 4)), prefill_budget=draw(st.integers(1, 32)),
                             cache=draw(st.sampled_from(['radix', 'radix', 'naive'])), overlap=overlap,
                             schedule_policy=policy,
                             # mixed: no time target, one every step misses (the least prompt a step takes), one that holds
                             itl_target=draw(st.sampled_from([None, 1e-9, 1.0])) if policy == 'mixed' else None)
    return Scenario(page_size, draw(st.integers(12 // page_size, 48 // page_size)), vocab,
                    draw(st.sampled_from([(0,), ()])), config, tuple(arrivals))


def detokenize(ids: list[int]) -> str:
    "A toy detokenizer: one letter per token id."
    return ''.join(chr(ord('a') + i % 26) for i in ids)


_solo_cache: dict = {}

def solo(sc: Scenario, a: Arrival) -> list:
    "What request `a` produces alone on the same engine: [(token_id, finish_reason, error)]."
    key = (sc.page_size, sc.num_pages, sc.vocab_size, sc.eos, a.prompt, repr(a.params))
    if key not in _solo_cache:
        s = Scheduler(sc.engine(), SchedulerConfig(max_running_reqs=1), detokenize=detokenize)
        s.submit(UserMsg(0, list(a.prompt), a.params))
        _solo_cache[key] = [(o.token_id, o.finish_reason, o.error) for o in s.run_until_idle()[0]]
    return _solo_cache[key]


def drive(sc: Scenario) -> dict[int, list]:
    inbox: list = []
    sched = Scheduler(sc.engine(slow=sc.config.overlap), sc.config, detokenize=detokenize,
                      recv_fn=lambda blocking: [inbox.pop(0) for _ in range(len(inbox))])
    last_event = max(max(a.round, a.abort_round or 0) for a in sc.arrivals)
    limit = last_event + 20 + 3 * sum(len(a.prompt) + a.params.max_tokens for a in sc.arrivals)
    outputs: dict[int, list] = {a.uid: [] for a in sc.arrivals}
    try:
        for rnd in range(limit):
            inbox += [UserMsg(a.uid, list(a.prompt), a.params) for a in sc.arrivals if a.round == rnd]
            inbox += [AbortMsg(a.uid) for a in sc.arrivals if a.abort_round == rnd]
            for o in sched.step():
                assert not (outputs[o.uid] and outputs[o.uid][-1].finished), f"output after finish: {o}"
                outputs[o.uid].append(o)
            sched.check_integrity()
            if rnd >= last_event and sched.is_idle and not inbox: break
        else:
            raise AssertionError(f"starvation: not idle after {limit} rounds; waiting "
                                 f"{[p.uid for p in sched.prefill_manager.pending_list]}")
        cm, tm = sched.cache_manager, sched.table_manager
        assert cm.num_owned_pages == 0 and cm.num_free_pages + cm.num_cached_pages == cm.num_pages
        assert tm.available_size == tm.max_running_reqs
    finally:
        sched.close()
    return outputs


def check(sc: Scenario):
    outputs = drive(sc)
    for a in sc.arrivals:
        got = [(o.token_id, o.finish_reason, o.error) for o in outputs[a.uid]]
        alone = solo(sc, a)
        assert got and outputs[a.uid][-1].finished, f"uid {a.uid} never finished"
        assert sum(o.finished for o in outputs[a.uid]) == 1
        if got[-1][1] == 'abort':
            assert a.abort_round is not None
            assert got[:-1] == alone[:len(got) - 1], f"uid {a.uid}: {got} is not a prefix of {alone}"
            continue
        assert got == alone, f"uid {a.uid}: batched {got} != alone {alone}"
        tokens, reason = [t for t, _, _ in got], got[-1][1]
        if reason == 'length': assert len(tokens) == a.params.max_tokens
        elif reason == 'stop':
            text = outputs[a.uid][-1].text
            if text is not None:     # a stop string: the text is cut before its first occurrence
                full = detokenize(tokens)
                assert any(full.startswith(text + s) for s in a.params.stop) and not any(s in text for s in a.params.stop)
            else:
                assert tokens[-1] in a.params.stop_token_ids or (not a.params.ignore_eos and tokens[-1] in sc.eos)
            assert len(tokens) <= a.params.max_tokens
        else:
            assert reason == 'error' and got[0][2]
            too_long = len(a.prompt) + a.params.max_tokens > MAX_SEQ_LEN
            too_big = -(-(len(a.prompt) + a.params.max_tokens) // sc.page_size) > sc.num_pages
            assert too_long or too_big, f"uid {a.uid} rejected: {got[0][2]}"


SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenarios(overlap=False))
def test_normal_loop(sc: Scenario): check(sc)


@SETTINGS
@given(scenarios(overlap=True))
def test_overlap_loop(sc: Scenario): check(sc)


@SETTINGS
@given(scenarios(overlap=False, policy='mixed'))
def test_normal_loop_mixed_batches(sc: Scenario): check(sc)


@SETTINGS
@given(scenarios(overlap=True, policy='mixed'))
def test_overlap_loop_mixed_batches(sc: Scenario): check(sc)


def test_solo_stop_conditions():
    "The reference itself: a solo run ends at max_tokens or at its stop token, never beyond."
    sc = Scenario(1, 64, 8, (0,), SchedulerConfig(), ())
    for ignore in (False, True):
        a = Arrival(0, 0, (1, 2, 3), SamplingParams(max_tokens=8, ignore_eos=ignore), None)
        out = solo(sc, a)
        toks = [t for t, _, _ in out]
        assert len(toks) == 8 or (not ignore and toks[-1] == 0 and out[-1][1] == 'stop')
        assert 0 not in toks[:-1] or ignore


def test_long_prompt_is_rejected_not_dropped():
    for overlap in (False, True):
        inbox = [UserMsg(1, list(range(MAX_SEQ_LEN + 1)), SamplingParams(max_tokens=1))]
        s = Scheduler(ToyEngine(max_seq_len=MAX_SEQ_LEN, vocab_size=64), SchedulerConfig(overlap=overlap),
                      recv_fn=lambda blocking: [inbox.pop() for _ in range(len(inbox))])
        (out,) = s.step()
        s.close()
        assert (out.uid, out.finished, out.finish_reason) == (1, True, 'error')
        assert f"{MAX_SEQ_LEN + 1} tokens" in out.error and str(MAX_SEQ_LEN) in out.error


def test_chunk_repoints_to_cached_prefix():
    "X is being chunked when Y caches the same prefix: X's duplicate pages are freed only after X's row reads Y's."
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    y_msg = UserMsg(0, prefix + [7], SamplingParams(max_tokens=1))            # computed and cached in round 0
    x_msg = UserMsg(1, prefix + [8, 8, 8, 8, 8], SamplingParams(max_tokens=4, ignore_eos=True))   # chunked
    for page_size in (1, 2):
        for overlap in (False, True):
            eng = lambda: ToyEngine(num_pages=64 // page_size, page_size=page_size, max_seq_len=MAX_SEQ_LEN)
            s = Scheduler(eng(), SchedulerConfig(prefill_budget=12, overlap=overlap))
            for m in (y_msg, x_msg): s.submit(m)
            res = {}
            while True:
                for o in s.step(): res.setdefault(o.uid, []).append(o.token_id)
                s.check_integrity()
                if s.is_idle: break
            s.close()
            alone = Scheduler(eng(), SchedulerConfig())
            alone.submit(x_msg)
            assert res[1] == [o.token_id for o in alone.run_until_idle()[1]]
