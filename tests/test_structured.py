"""Structured output end to end (chapter grammar, wired through the protocol, the scheduler and the engine):
the embedded model at temperature 1 under a JSON schema, a regex and `json_object`, through the official
`openai` client (`chat.completions.parse` with a pydantic model included), streamed and not; constrained and
unconstrained requests in one batch; an aborted constrained stream leaves no matcher behind. The server
runs the overlap loop, the offline checks the normal one."""
from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

from minisgl.core import SamplingParams
from server_utils import ServerProc

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


@pytest.fixture(scope="module")
def server():
    s = ServerProc("--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--max-seq-len", "1024", "--overlap",
                   "--kernels", "q8dot")   # natively on q8dot: a request is served the same bits beside any others (chapter engine)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=180)


def _schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def test_json_schema_at_temperature_one_always_validates(client):
    r = client.chat.completions.create(model="default", messages=ASK, response_format=_schema_format(),
                                       temperature=1.0, seed=11, n=8, max_tokens=80)
    texts = [c.message.content for c in r.choices]
    for c, t in zip(r.choices, texts):
        assert c.finish_reason == "stop", (c.finish_reason, t)
        jsonschema.validate(json.loads(t), SCHEMA)
    assert len(set(texts)) > 1, "temperature 1 with 8 seeds gave one answer: is it sampling?"


def test_regex_and_json_object_on_completions(client):
    r = client.completions.create(model="default", prompt="Is the sky blue? Answer:", temperature=1.0, seed=3, n=6,
                                  max_tokens=8, extra_body={"regex": " (yes|no)(, definitely)?"})
    for c in r.choices:
        assert re.fullmatch(r" (yes|no)(, definitely)?", c.text), c.text
    r = client.completions.create(model="default", prompt="A JSON object describing a cat:", temperature=1.0, seed=5,
                                  n=4, max_tokens=60, extra_body={"response_format": {"type": "json_object"}})
    for c in r.choices:
        if c.finish_reason == "stop": assert isinstance(json.loads(c.text), dict), c.text
        else: assert c.text.lstrip().startswith("{"), c.text       # cut at max_tokens: a prefix of an object


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_openai_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(model="default", messages=ASK, response_format=Person, temperature=0.7, seed=1,
                                         max_tokens=80)
    person = done.choices[0].message.parsed
    assert isinstance(person, Person), done.choices[0].message.content


def test_streamed_deltas_make_the_same_valid_json(client):
    kw = dict(model="default", messages=ASK, response_format=_schema_format(), temperature=1.0, seed=21, max_tokens=80)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    assert "".join(parts) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_unconstrained_neighbours_are_unchanged(client):
    plain = dict(model="default", prompt="The capital of France is", max_tokens=12, temperature=0)
    alone = client.completions.create(**plain).choices[0].text
    with cf.ThreadPoolExecutor(4) as ex:
        constrained = [ex.submit(client.chat.completions.create, model="default", messages=ASK, max_tokens=60,
                                 response_format=_schema_format(), temperature=1.0, seed=s) for s in range(3)]
        together = ex.submit(client.completions.create, **plain)
        assert together.result().choices[0].text == alone
        for f in constrained: jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMA)


def test_aborted_constrained_stream_frees_its_matcher(server):
    body = {"messages": ASK, "response_format": _schema_format({"type": "array", "items": {"type": "integer"}}),
            "temperature": 1.0, "seed": 2, "max_tokens": 400, "stream": True}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3: break                     # a few chunks, then the client goes away
    for _ in range(100):
        s = httpx.get(server.base + "/debug/scheduler", timeout=10).json()
        if s["running"] == 0 and s["grammar_matchers"] == 0: break
        time.sleep(0.1)
    assert (s["grammar_matchers"], s["grammars_compiling"], s["integrity"]) == (0, 0, "ok"), s


def test_bad_constraints_are_400s(server):
    for body, param in [({"regex": "(unclosed"}, "regex"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, "response_format"),
                        ({"ebnf": "root ::= "}, "ebnf")]:
        r = httpx.post(server.base + "/v1/completions", json={"prompt": "hi", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_offline_llm_takes_the_same_constraints():
    from minisgl.grammar import Constraint
    from minisgl.llm import LLM
    llm = LLM(dtype="float32", device="cpu", num_pages=256, max_seq_len=512)
    outs = llm.chat([ASK] * 4, SamplingParams(max_tokens=80, temperature=1.0, seed=9,
                                              constraint=Constraint("json_schema", json.dumps(SCHEMA))))
    for o in outs: jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert llm.scheduler.matchers == {} and llm.scheduler.grammar_waiting == []


def test_a_compiling_grammar_is_not_slept_through():
    "The scheduler's receive blocks only when there is no work; a request waiting for its grammar is work (a ZMQ receive would sleep)."
    from minisgl.grammar import Constraint
    from minisgl.messages import UserMsg
    from minisgl.scheduler import Scheduler, ToyEngine
    from minisgl.weights import load_tokenizer
    tok = load_tokenizer()
    toy = ToyEngine(num_pages=256, page_size=16, max_seq_len=256, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id])
    toy.tokenizer = tok                  # what `Engine` has: the scheduler builds its grammar cache from it
    inbox = [UserMsg(1, tok.encode("hi"), SamplingParams(max_tokens=4, ignore_eos=True, constraint=Constraint("regex", "[a-z]+")))]
    def recv(blocking):
        if inbox: return [inbox.pop()]
        assert not blocking, "the scheduler blocked on its inbox while a grammar was compiling"
        return []
    sched = Scheduler(toy, recv_fn=recv)
    outs, seen = [], set()
    for _ in range(10_000):
        outs += sched.step()
        seen |= set(sched.matchers)
        if any(o.finished for o in outs): break
    assert [o.finish_reason for o in outs if o.finished] == ["length"] and seen == {1}
    assert sched.matchers == {} and sched.grammar_waiting == []
    sched.check_integrity()
