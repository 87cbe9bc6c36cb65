"""Constrained decoding (chapter `grammar`) with the real SmolLM2 tokenizer and model: constraints refused with
the field they came from, compiles shared and off the caller's thread, masks that leave other rows alone,
matcher rollback and termination, and sampled outputs that always parse (JSON schema, regex, EBNF)."""
import inspect, json, re, threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from minisgl.core import ParamError, SamplingParams
from minisgl.grammar import (Constraint, GrammarCache, RequestMatcher, allowed_tokens, apply_masks, bitmask_buffer,
                             check_constraint, request_constraint, token_bitmask)
from minisgl.sampling import SamplingBatch, sample
from minisgl.weights import eos_token_ids, load_hf_config, load_tokenizer, resolve_model

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
DATE = r'[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])'


@pytest.fixture(scope='module')
def env():
    model_dir = resolve_model(None, progress=False)
    tok = load_tokenizer()
    V = load_hf_config(model_dir)['vocab_size']
    grammars = GrammarCache(tok, V, eos_token_ids(model_dir, tok))
    yield dict(model_dir=model_dir, tok=tok, V=V, eos=eos_token_ids(model_dir, tok), grammars=grammars)
    grammars.close()


@pytest.mark.parametrize('kind, spec, param, fragment', [
    ('json_schema', '{"type": "objec"}', 'response_format', 'invalid JSON schema: Unsupported type "objec"'),
    ('json_schema', '{"type": "string", "minLength": "x"}', 'response_format', 'minLength must be an integer'),
    ('json_schema', '{"properties": {"a": {"$ref": "#/$defs/missing"}}}', 'response_format', 'invalid JSON schema'),
    ('json_schema', '{"a": 1', 'response_format', 'not valid JSON'),
    ('json_schema', '"string"', 'response_format', 'must be a JSON object'),
    ('json_schema', '[' * 65 + ']' * 65, 'response_format', 'must be a JSON object'),
    ('json_schema', '{"not": ' * 65 + '{}' + '}' * 65, 'response_format', 'nests deeper than 64'),
    ('json_schema', '{"description": "' + 'x' * 100_001 + '"}', 'response_format', 'more than 100000'),
    ('json_object', '{}', 'response_format', 'takes no spec'),
    ('regex', '[a-', 'regex', 'invalid regular expression'),
    ('regex', 'a{3,1}', 'regex', 'Lower bound is larger than upper bound'),
    ('regex', '(?<=a)b', 'regex', 'invalid regular expression'),
    ('regex', '  ', 'regex', 'must not be empty'),
    ('ebnf', 'root ::= "a', 'ebnf', 'Expect " in string literal'),
    ('ebnf', 'root ::= undefined_rule', 'ebnf', 'Rule "undefined_rule" is not defined'),
    ('ebnf', 'answer ::= "a"', 'ebnf', 'root rule'),
    ('ebnf', 'root ::= "\udc80"', 'ebnf', 'not valid text'),
    ('grammar', 'x', 'response_format', 'constraint kind must be one of'),
])
def test_bad_constraints_are_refused_with_their_field(kind, spec, param, fragment):
    with pytest.raises(ParamError) as e: Constraint(kind, spec)
    assert e.value.param == param and fragment in str(e.value), str(e.value)
    assert '/project/cpp' not in str(e.value)                       # no C++ log prefix in what a client reads


def test_good_constraints_pass_without_a_tokenizer():
    for kind, spec in [('json_object', ''), ('json_schema', json.dumps(PERSON)), ('json_schema', '{}'), ('regex', DATE),
                       ('ebnf', 'root ::= "The answer is " ("yes" | "no") "."'),
                       ('json_schema', json.dumps({"$defs": {"P": PERSON}, "type": "object",
                                                   "properties": {"people": {"type": "array", "items": {"$ref": "#/$defs/P"}}},
                                                   "required": ["people"]}))]:
        check_constraint(kind, spec)
        assert Constraint(kind, spec).grammar() is not None


def test_request_constraint_reads_openai_and_sglang_fields():
    pydantic_like = {'type': 'json_schema', 'json_schema': {'name': 'Person', 'strict': True, 'schema': PERSON}}
    assert request_constraint(pydantic_like) == Constraint.json_schema(PERSON)
    assert request_constraint({'type': 'text'}, ebnf='root ::= "a"') == Constraint('ebnf', 'root ::= "a"')
    for bad, fragment in [(dict(response_format='json'), 'must be an object'),
                          (dict(response_format={'type': 'json_schema'}), '"schema" object'),
                          (dict(regex='a', ebnf='root ::= "a"'), 'only one of regex, ebnf')]:
        with pytest.raises(ParamError, match=re.escape(fragment)): request_constraint(**bad)


def test_submit_returns_before_the_compile_and_shares_it(env, monkeypatch):
    grammars = GrammarCache(env['tok'], env['V'], env['eos'], threads=2)
    release, started = threading.Event(), threading.Event()
    real = grammars._compile
    def slow(c):
        started.set(); release.wait(30); return real(c)
    monkeypatch.setattr(grammars, '_compile', slow)
    f = grammars.submit(Constraint.json_schema(PERSON))
    assert started.wait(30) and not f.done()                          # the caller got its future while the compile waits
    same = [None] * 8
    def ask(i): same[i] = grammars.submit(Constraint('json_schema', json.dumps(PERSON, separators=(',', ':'))))
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert all(s is f for s in same) and len(grammars) == 1
    release.set()
    assert isinstance(f.result(30), xgr.CompiledGrammar)
    grammars.close()


def _matcher_at(env, constraint, text):
    m = RequestMatcher(env['grammars'].submit(constraint).result())
    for t in env['tok'].encode(text): assert m.accept(t), text
    return m


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_apply_masks_leaves_other_rows_bit_for_bit(env, dtype):
    V, person = env['V'], Constraint.json_schema(PERSON)
    ms = {1: _matcher_at(env, person, '{"name": "Al'), 4: _matcher_at(env, person, '{"name": "Al", "age": 4'),
          6: _matcher_at(env, Constraint('regex', DATE), '19')}
    logits = torch.randn(8, V).to(dtype); before = logits.clone()
    apply_masks(logits, list(ms), list(ms.values()))
    others = [r for r in range(8) if r not in ms]
    assert torch.equal(logits[others], before[others])
    bm = xgr.allocate_token_bitmask(1, V)
    for row, m in ms.items():
        m.fill(bm, 0)
        ok = torch.zeros(V, dtype=torch.bool); ok[allowed_tokens(bm[0], V)] = True
        assert 0 < ok.sum() < V
        assert torch.equal(logits[row][ok], before[row][ok]) and torch.isneginf(logits[row][~ok]).all()


def test_bitmask_buffer_is_reused(env):
    V = env['V']
    a = bitmask_buffer(4, V)
    assert bitmask_buffer(2, V).data_ptr() == a.data_ptr() and bitmask_buffer(4, V).shape == (4, (V + 31) // 32)
    big = bitmask_buffer(1000, V)                                      # grown once, then reused
    assert bitmask_buffer(999, V).data_ptr() == big.data_ptr()


def test_rollback_restores_every_earlier_mask(env):
    V, tok = env['V'], env['tok']
    m = RequestMatcher(env['grammars'].submit(Constraint.json_schema(PERSON)).result())
    bm = xgr.allocate_token_bitmask(1, V)
    masks, tokens = [], tok.encode('{"name": "Bob", "age": 42}')
    for t in tokens:
        m.fill(bm, 0); masks.append(bm.clone())
        assert m.accept(t)
    assert m.is_completed and len({tuple(x.flatten().tolist()) for x in masks}) > 3
    for i in reversed(range(len(tokens))):
        m.rollback(1); m.fill(bm, 0)
        assert torch.equal(bm, masks[i]), i
    with pytest.raises(ParamError, match='rollback'): m.rollback(1)


def test_a_finished_matcher_allows_only_its_stop_tokens(env):
    V, tok = env['V'], env['tok']
    stops = [env['eos'][0], 0]                                         # a request's own stop ids override the model's
    m = RequestMatcher(env['grammars'].submit(Constraint('regex', '(yes|no)')).result(), stop_token_ids=stops)
    bm = xgr.allocate_token_bitmask(1, V)
    assert m.accept(tok.convert_tokens_to_ids('no')) and m.is_completed and not m.is_terminated
    m.fill(bm, 0); assert allowed_tokens(bm[0], V).tolist() == sorted(stops)
    assert not m.accept(tok.convert_tokens_to_ids('yes'))
    assert m.accept(0) and m.is_terminated
    m.fill(bm, 0); assert allowed_tokens(bm[0], V).tolist() == sorted(stops)
    assert not m.accept(0) and not m.accept(env['eos'][0])
    assert token_bitmask(stops, V).tolist() == bm[0].tolist()


# ---- the real model, sampled at temperature 1 under each kind of constraint

@pytest.fixture(scope='module')
def hf(env):
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.logging.set_verbosity_error()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # these decode steps are too short to share: two busy threads wait on each other
    yield AutoModelForCausalLM.from_pretrained(str(env['model_dir']), dtype=torch.float32).eval()
    torch.set_num_threads(threads)


@torch.inference_mode()
def _sample(env, hf, question, constraint, seeds, max_new=48, temperature=1.0):
    "One answer per seed under `constraint`, all rows in one batch, plus a last unconstrained row; texts, terminated flags."
    from transformers import DynamicCache
    tok, V = env['tok'], env['V']
    fwd = inspect.signature(hf.forward).parameters
    def last_logits(inp, cache):
        kw = {'cache' if 'cache' in fwd else 'past_key_values': cache}
        if 'logits_to_keep' in fwd: kw['logits_to_keep'] = 1
        return hf(inp, use_cache=True, **kw).logits[:, -1].float()
    text = tok.apply_chat_template([{'role': 'user', 'content': question}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors='pt', add_special_tokens=False).input_ids
    B, L = len(seeds) + 1, ids.shape[1]
    compiled = env['grammars'].submit(constraint).result()
    ms = [RequestMatcher(compiled) for _ in seeds]
    sb = SamplingBatch.from_params([SamplingParams(temperature=temperature, seed=s) for s in seeds + [0]], V)
    cache, outs, live = DynamicCache(), [[] for _ in seeds], list(range(len(seeds)))
    logits = last_logits(ids, cache).repeat(B, 1)
    cache.batch_repeat_interleave(B)
    for step in range(max_new):
        if step: logits = last_logits(inp, cache)
        free = logits[-1].clone()
        apply_masks(logits, live, [ms[i] for i in live])
        assert torch.equal(logits[-1], free)
        tokens = sample(logits, sb, torch.full((B,), L + step)).tokens.tolist()
        for i in list(live):
            assert ms[i].accept(tokens[i]), (i, tokens[i])
            if ms[i].is_terminated: live.remove(i)
            else: outs[i].append(tokens[i])
        if not live: break
        inp = torch.tensor(tokens)[:, None]
    return [tok.decode(o) for o in outs], [m.is_terminated for m in ms]


def test_every_sample_validates_against_the_schema(env, hf):
    texts, done = _sample(env, hf, 'Describe a person as JSON with a name and an age.', Constraint.json_schema(PERSON),
                          seeds=list(range(10, 22)))
    assert all(done), texts
    for t in texts: jsonschema.validate(json.loads(t), PERSON)


def test_every_sample_matches_the_regex(env, hf):
    texts, done = _sample(env, hf, 'When did the French Revolution begin? Give the date.', Constraint('regex', DATE),
                          seeds=list(range(20, 32)), max_new=16)
    assert all(done) and all(re.fullmatch(DATE, t) for t in texts), texts


def test_ebnf_and_json_object(env, hf):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    texts, done = _sample(env, hf, 'Is the Earth round?', Constraint('ebnf', grammar), seeds=[1, 2, 3, 4], max_new=12)
    assert all(done) and all(t in ('The answer is yes.', 'The answer is no.') for t in texts), texts
    (text,), (done,) = _sample(env, hf, 'Reply with a JSON object with the key "city" set to "Paris".',
                               Constraint('json_object'), seeds=[0], temperature=0.0)
    assert done and isinstance(json.loads(text), dict), text


def test_a_pydantic_schema_with_refs(env, hf):
    from typing import Literal
    from pydantic import BaseModel, Field
    class Pet(BaseModel):
        name: str = Field(max_length=10)
        kind: Literal['cat', 'dog', 'bird']
        age: int = Field(ge=0, le=30)
    class Household(BaseModel):
        city: str = Field(max_length=16)
        pets: list[Pet] = Field(min_length=1, max_length=2)
    schema = Household.model_json_schema()
    assert '$defs' in schema
    texts, done = _sample(env, hf, 'Describe a household with its city and one or two pets, as JSON.',
                          Constraint.json_schema(schema), seeds=list(range(40, 48)), max_new=128)
    assert all(done), texts
    for t in texts: Household.model_validate_json(t); jsonschema.validate(json.loads(t), schema)
