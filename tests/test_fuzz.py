"""Fuzzing the HTTP API on the `ToyEngine`: schemathesis over `/openapi.json` (bounded examples, every check but
positive-data acceptance: the schema states the JSON types, `SamplingParams` owns the value ranges), then a
hypothesis mutation fuzzer of chat and completion bodies. Every response is a 2xx or a well-formed 4xx, never a
5xx, and afterwards the server is alive, correct, and owns no KV page."""
from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import positive_data_acceptance

from minisgl.server import Frontend, ServerArgs, build_app
from server_utils import ServerProc

SCHEMA = schemathesis.openapi.from_dict(build_app(Frontend(ServerArgs())).openapi())
SEEN = {"requests": 0, "5xx": 0}


@pytest.fixture(scope="module")
def fuzzed():
    s = ServerProc("--max-seq-len", "64", "--num-pages", "64", "--max-request-bytes", str(1 << 20), toy=True)
    yield s
    try:
        r = httpx.post(s.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        dbg = httpx.get(s.base + "/debug/scheduler").json()
        assert dbg["integrity"] == "ok" and dbg["pages_owned"] == 0, dbg
        print(f"\nfuzzed {SEEN['requests']} requests, {SEEN['5xx']} answered 5xx; pages owned afterwards: {dbg['pages_owned']}")
    finally:
        assert s.stop() == 0, s.output()


@SCHEMA.parametrize()
@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis(case, fuzzed):
    r = case.call_and_validate(base_url=fuzzed.base, excluded_checks=[positive_data_acceptance], timeout=30)
    SEEN["requests"] += 1
    SEEN["5xx"] += r.status_code >= 500


# a mutation fuzzer: valid bodies, then one field (known or not) set to a hostile value
HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([2**63, -2**63 - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-300, -0.0, 5e-324, 1e308]),
    st.text(max_size=50), st.sampled_from(["\udc80", "a\ud800b", "\x00", "\u202e", "💥" * 300, "x" * 20_000]),
    st.lists(st.integers(min_value=-5, max_value=2**40), max_size=20), st.lists(st.text(max_size=5), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.integers(min_value=1, max_value=400).map(lambda d: json.loads("[" * d + "]" * d)))
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "stream",
          "stream_options", "logprobs", "top_logprobs", "prompt", "messages", "user", "tools", "response_format", "xyz"]


@st.composite
def mutated(draw):
    chat = draw(st.booleans())
    body = {"max_tokens": draw(st.integers(1, 8)), "temperature": draw(st.sampled_from([0, 1]))}
    if chat: body["messages"] = [{"role": "user", "content": draw(st.text(max_size=30))}]
    else: body["prompt"] = draw(st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 49151), min_size=1, max_size=8)))
    for _ in range(draw(st.integers(1, 3))):
        field = draw(st.sampled_from(FIELDS + ["messages.content", "messages.role", "messages.name"]))
        value = draw(HOSTILE)
        msgs = body.get("messages")
        if field.startswith("messages."):
            if chat and isinstance(msgs, list) and msgs and isinstance(msgs[0], dict): msgs[0][field.split(".")[1]] = value
        else: body[field] = value
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def http():
    "One kept-alive client: a new `httpx.Client` per request costs ~40 ms (its TLS context), as long as a toy request."
    with httpx.Client(timeout=30) as c: yield c


@given(mutated())
@settings(max_examples=2500, deadline=None, suppress_health_check=list(HealthCheck))
def test_mutation_fuzzer(fuzzed, http, case):
    path, body = case
    raw = json.dumps(body, allow_nan=True).encode()
    r = http.post(fuzzed.base + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
    SEEN["requests"] += 1
    SEEN["5xx"] += r.status_code >= 500
    assert r.status_code < 500, (r.status_code, r.text[:300], raw[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 600, err
    elif not body.get("stream"):
        assert r.json()["choices"], r.text[:300]
