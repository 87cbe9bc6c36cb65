"""Tool calling end to end (chapter grammar's "Tool calls", wired through the protocol, `render_chat` and the chat
route): the embedded SmolLM2-135M-Instruct, whose template knows no tools (so the Hermes system block), through the
official `openai` client. Forced choices (`required`, a named function) at temperature 1 always give calls whose
arguments validate; `auto` gives what the parser makes of the model's actual text; streamed deltas reassemble to the
non-streamed answer; bad tools are 400s naming the field; a conversation with tool results renders and answers.
The parser's own rules (split points, several calls, malformed blocks) are checked first, without a server."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings, strategies as st

from minisgl.grammar import ToolCall, ToolCallParser, parse_tool_calls
from server_utils import ServerProc

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ASK_MATH = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


# the parser, without a server

def _stream(text: str, cuts: list[int], names=frozenset(SCHEMAS)) -> tuple[str, list[ToolCall]]:
    "Feed `text` cut at `cuts`, as a stream would arrive; what the pieces add up to."
    p, items, last = ToolCallParser(set(names)), [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        items += p.feed(text[last:c]); last = c
    items += p.finish()
    return "".join(x for x in items if isinstance(x, str)), [x for x in items if isinstance(x, ToolCall)]


PIECES = ["Sure.", " ", "\n", CALL, CALL.replace("Paris", "Rome"), "<tool_call>{bad json</tool_call>", "<tool_",
          '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "</tool_call>", "then", "<tool_call>\n{\"name\""]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=8).map("".join).flatmap(
    lambda t: st.tuples(st.just(t), st.lists(st.integers(0, max(len(t), 1)), max_size=12))))
def test_any_split_gives_the_whole_texts_answer(text_cuts):
    text, cuts = text_cuts
    assert _stream(text, cuts) == parse_tool_calls(text, set(SCHEMAS))


def test_parser_rules():
    content, calls = parse_tool_calls("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n", set(SCHEMAS))
    assert content == "Let me look." and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert calls[0] == ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
    for text in ['x <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call> y',   # malformed JSON
                 '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',       # arguments not an object
                 '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',               # not a given tool
                 CALL[:-2]]:                                                                    # never closed
        assert parse_tool_calls(text, set(SCHEMAS)) == (text, []), text
    assert parse_tool_calls("4", set(SCHEMAS)) == ("4", [])
    # held back while undecided, given out once decided
    p = ToolCallParser(set(SCHEMAS))
    assert p.feed("Hi <tool_") == ["Hi"] and p.feed("call>\n{") == [] and p.feed(CALL[13:]) == [ToolCall("get_weather", calls[0].arguments)]
    assert p.feed("\n") == [] and p.finish() == []
    p = ToolCallParser(set(SCHEMAS))
    assert p.feed("a <tool") == ["a"] and p.feed("box") == [" <toolbox"]


# the server

@pytest.fixture(scope="module")
def server():
    s = ServerProc("--dtype", "float32", "--device", "cpu", "--num-pages", "512", "--max-seq-len", "1024")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=180)


def _check_calls(choice, names):
    "A forced choice: it stopped after calling, every call is of a given tool, its arguments valid for that tool's schema."
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls, (choice.finish_reason, choice.message)
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names, c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_at_temperature_one_always_validate(client, choice):
    names = set(SCHEMAS) if choice == "required" else {"get_time"}
    seen = []
    for seed in (1, 2):
        r = client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice,
                                           temperature=1.0, seed=seed, n=3, max_tokens=160)
        for c in r.choices:
            seen.append(_check_calls(c, names))
            if choice != "required": assert len(c.message.tool_calls) == 1      # a named choice: that one call
    if choice == "required":   # a choice of tools leaves room to differ; get_time's one argument the model may be sure of
        assert len({json.dumps(s) for s in seen}) > 1, "temperature 1 with 6 seeds gave one answer: is it sampling?"


def _raw_text(client, messages, tools, **kw) -> tuple[str, str]:
    "What the model writes for this chat, unparsed, and why it ended: the same prompt (`render_chat`'s) through /v1/completions."
    from minisgl.tokenizer import render_chat
    from minisgl.weights import load_tokenizer
    tok = load_tokenizer()
    ids = tok.encode(render_chat(tok, messages, tools), add_special_tokens=False)
    c = client.completions.create(model="default", prompt=ids, **kw).choices[0]
    return c.text, c.finish_reason


@pytest.mark.parametrize("messages", [ASK_MATH, ASK_WEATHER])
def test_auto_answers_what_the_parser_makes_of_the_text(client, messages):
    "Under auto the model chooses; whatever it wrote, the answer is the parser's split of that text (content, calls or both)."
    for seed in (3,) if messages is ASK_MATH else (3, 4):
        kw = dict(temperature=1.0, seed=seed, max_tokens=80)
        r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice="auto", **kw)
        m, (raw, reason) = r.choices[0].message, _raw_text(client, messages, TOOLS, **kw)
        content, calls = parse_tool_calls(raw, set(SCHEMAS))
        got = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
        assert got == [(c.name, c.arguments) for c in calls], (raw, m)
        assert m.content == (content or None if calls else content), (raw, m)
        assert r.choices[0].finish_reason == ("tool_calls" if calls and reason == "stop" else reason)
        if not calls: assert m.content == raw


def _reassemble(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    "Content, calls (name, arguments) and finish_reason of a streamed chat, put together as a client does."
    content, calls, reason = "", {}, None
    for ch in stream:
        if not ch.choices: continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:          # a call's first delta: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        reason = ch.choices[0].finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_deltas_reassemble_to_the_same_answer(client, choice):
    for seed in ((7, 8) if choice == "required" else (7,)):
        kw = dict(model="default", messages=ASK_WEATHER, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed, max_tokens=160)
        whole = client.chat.completions.create(**kw).choices[0]
        content, calls, reason = _reassemble(client.chat.completions.create(**kw, stream=True))
        assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert (content, reason) == (whole.message.content or "", whole.finish_reason)
        if choice == "required": assert calls and reason == "tool_calls"


def test_none_renders_no_tools_and_parses_nothing(client):
    r = client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                       temperature=1.0, seed=1, max_tokens=48)
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    assert r.usage.prompt_tokens < client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS,
                                                                  max_tokens=1).usage.prompt_tokens   # auto: the tools block


def test_bad_tools_are_400s_that_name_them(server):
    bad_schema = {"type": "function", "function": {"name": "broken", "parameters": {"type": "objec"}}}
    named = lambda name: {"type": "function", "function": {"name": name}}
    for body, param, says in [({"tools": [WEATHER, bad_schema]}, "tools.1.function.parameters", "'broken'"),
                              ({"tools": TOOLS, "tool_choice": named("get_stock")}, "tool_choice", "'get_stock'"),
                              ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "'always'"),
                              ({"tool_choice": "required"}, "tool_choice", "needs tools"),
                              ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "'a b'"),
                              ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                               "tool_choice", "response_format")]:
        r = httpx.post(server.base + "/v1/chat/completions", json={"messages": ASK_WEATHER, **body}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and says in err["message"], (body, r.text)


def test_bad_tools_through_the_client(client):
    with pytest.raises(openai.BadRequestError, match="get_stock"):
        client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})


def test_a_conversation_with_a_tool_result_renders_and_answers(client):
    messages = [*ASK_WEATHER,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model="default", messages=messages, tools=TOOLS, tool_choice=choice,
                                           temperature=0, max_tokens=48)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls") and (c.message.content or c.message.tool_calls), c
        assert r.usage.prompt_tokens > 40                       # the call and its result are in the prompt
