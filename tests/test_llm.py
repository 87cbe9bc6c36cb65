"""The offline `LLM` with the real SmolLM2 engine: its API, its input checks, and the same greedy tokens as the server."""
from __future__ import annotations

import threading

import openai
import pytest

from minisgl.core import SamplingParams
from minisgl.llm import LLM
from server_utils import ServerProc

ARGS = dict(dtype="float32", device="cpu", num_pages=256, max_seq_len=1024, kernels="q8dot")   # the server's tokens are compared: q8dot (see test_server_openai)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server_and_llm():
    "Start the server (a subprocess) while the LLM loads here: the two loads overlap."
    box = {}
    def start():
        try: box["server"] = ServerProc("--dtype", "float32", "--device", "cpu", "--num-pages", "256", "--max-seq-len", "1024", "--kernels", "q8dot")
        except Exception as e: box["error"] = e
    th = threading.Thread(target=start); th.start()
    llm = LLM(**ARGS)
    th.join()
    if "error" in box: raise box["error"]
    yield box["server"], llm
    assert box["server"].stop() == 0


@pytest.fixture(scope="module")
def llm(server_and_llm): return server_and_llm[1]


def test_same_greedy_tokens_as_the_server(server_and_llm):
    server, llm = server_and_llm
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    offline = llm.generate(PROMPTS, SamplingParams(max_tokens=6, logprobs=True))
    online = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS, max_tokens=6, temperature=0, logprobs=0)
    assert [c.index for c in online.choices] == [0, 1, 2]
    for off, on in zip(offline, online.choices):
        assert off.text == on.text
        assert len(off.token_ids) == len(on.logprobs.tokens) == 6
        assert off.outputs[0].logprobs == pytest.approx(on.logprobs.token_logprobs, abs=1e-3)
    chat_off = llm.chat(CHAT, SamplingParams(max_tokens=6))[0]
    chat_on = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=6, temperature=0)
    assert chat_off.text == chat_on.choices[0].message.content
    assert len(chat_off.token_ids) == chat_on.usage.completion_tokens


def test_generate_outputs(llm):
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=5))
    assert [o.prompt for o in outs] == PROMPTS[:2]
    for o in outs:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert o.text == llm.tokenizer.decode(o.token_ids)
    # token ids in, same answer out
    again = llm.generate([outs[0].prompt_token_ids], SamplingParams(max_tokens=5))[0]
    assert again.prompt is None and again.token_ids == outs[0].token_ids


def test_n_logprobs_stop_and_seed(llm):
    seeded = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2)
    o, greedy = llm.generate(["The capital of France is"] * 2, [seeded, SamplingParams(max_tokens=6)])
    assert [c.index for c in o.outputs] == [0, 1]
    for c in o.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 4 and all(len(t) == 2 for t in c.top_logprobs)
    stop = greedy.text[3:6]
    again, cut = llm.generate(["The capital of France is"] * 2, [seeded, SamplingParams(max_tokens=6, stop=[stop])])
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in o.outputs]
    greedy = greedy.text
    assert (cut.text, cut.finish_reason) == (greedy[:greedy.find(stop)], "stop")


def test_chat_and_stream(llm):
    o, other = llm.chat([CHAT, [{"role": "user", "content": "Say hi."}]], SamplingParams(max_tokens=16))
    assert o.finish_reason == "stop" and "4" in o.text          # the model ends its answer with EOS
    assert other.token_ids != o.token_ids
    assert "".join(llm.stream(CHAT, SamplingParams(max_tokens=5))) == llm.tokenizer.decode(o.token_ids[:5])


def test_stream_closed_early_frees_everything(llm):
    s = llm.stream("Once upon a time", SamplingParams(max_tokens=100))
    next(s); s.close()
    assert llm.scheduler.is_idle
    llm.scheduler.check_integrity()
    cm = llm.scheduler.cache_manager
    assert cm.num_owned_pages == 0 and cm.num_free_pages + cm.num_cached_pages == cm.num_pages


def test_progress_bar(llm, capsys):
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Generating" in capsys.readouterr().err


@pytest.mark.parametrize("call,message", [
    (lambda l: l.generate(""), "prompt: must not be empty"),
    (lambda l: l.generate([]), "prompts: must not be empty"),
    (lambda l: l.generate([[1, 10**7]]), "prompt: token ids must be in [0, 49152)"),
    (lambda l: l.generate("hi", SamplingParams(max_tokens=2000)), "prompt has 1 tokens, max_tokens 2000, context 1024"),
    (lambda l: l.generate(["a", "b"], [SamplingParams()]), "sampling_params: got 1 for 2 prompts"),
    (lambda l: l.chat([]), "messages: must be a non-empty list"),
])
def test_bad_input(llm, call, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        call(llm)


def test_left_out_sampling_is_the_models_recommendation_everywhere(server_and_llm):
    "`LLM` without sampling params and a server request that leaves them out sample alike: as the model recommends."
    from minisgl.weights import EMBEDDED_SAMPLING
    server, llm = server_and_llm
    assert llm.info["sampling_defaults"] == {k: v for k, v in EMBEDDED_SAMPLING.items() if k != "do_sample"} == {"temperature": 0.2, "top_p": 0.9}
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    differs = 0
    for seed in (1, 2, 3):
        offline = llm.generate([PROMPTS[2]], llm.default_params(max_tokens=12, seed=seed))[0].text
        left_out = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=12, seed=seed).choices[0].text
        given = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=12, seed=seed,
                                          temperature=0.2, top_p=0.9).choices[0].text
        hot = client.completions.create(model="default", prompt=PROMPTS[2], max_tokens=12, seed=seed,
                                        temperature=1.0, top_p=1.0).choices[0].text
        assert offline == left_out == given, (seed, offline, left_out, given)
        differs += hot != left_out
    assert differs, "OpenAI's temperature 1 samples otherwise: the left-out fields did take the model's values"


def test_clip_max_tokens_shortens_instead_of_refusing():
    "`clip_max_tokens=True` (mini-sglang's behaviour): a max_tokens past the context is cut to what it leaves."
    from minisgl.scheduler import ToyEngine
    toy = lambda: ToyEngine(num_pages=256, page_size=4, max_seq_len=32, vocab_size=64, eos_token_ids=[])
    prompt, sp = list(range(1, 21)), SamplingParams(max_tokens=50, ignore_eos=True)
    with pytest.raises(ValueError, match="prompt \\+ max_tokens must be <= context"):
        LLM(engine=toy()).generate([prompt], sp)
    llm = LLM(engine=toy(), clip_max_tokens=True)
    out = llm.generate([prompt], sp)[0]
    assert (len(out.token_ids), out.finish_reason) == (32 - 20, "length")
    assert llm.info["clip_max_tokens"] is True
    # the scheduler's own door (a direct submit, no tokenizer worker) clips the same way
    from minisgl.messages import UserMsg
    llm.scheduler.submit(UserMsg(999, prompt, sp))
    outs = llm.scheduler.run_until_idle()[999]
    assert len([o for o in outs if o.token_id is not None]) == 12 and outs[-1].finish_reason == "length"
