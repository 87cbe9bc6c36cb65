"""The command line: help, option errors, `minisgl shell`, and `minisgl serve`'s start-up and SIGINT shutdown
(the server's plumbing on the `ToyEngine`, through tests/toy_serve.py; the shell on the embedded model)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from server_utils import ENV, ServerProc, survivors, toy_engine

MINISGL = [sys.executable, "-m", "minisgl"]


def run(*args, input=None, timeout=120):
    return subprocess.run([*MINISGL, *args], input=input, capture_output=True, text=True, env=ENV, timeout=timeout)


def test_help():
    r = run("--help")
    assert r.returncode == 0
    for word in ("serve", "shell", "OpenAI-compatible", "examples:"):
        assert word in r.stdout
    r = run()
    assert r.returncode == 0 and "usage: minisgl" in r.stdout


def test_serve_help_lists_the_options():
    r = run("serve", "--help")
    assert r.returncode == 0
    for opt in ("--model", "--dtype", "--device", "--page-size", "--max-running-requests", "--prefill-budget",
                "--kv-memory-gb", "--num-pages", "--cache", "--overlap", "--max-queued-requests", "--log-level",
                "--host", "--port"):
        assert opt in r.stdout, opt
    assert "1919" in r.stdout and "127.0.0.1" in r.stdout
    assert "--engine" not in r.stdout          # the toy engine is for tests only


@pytest.mark.skipif(shutil.which("minisgl", path=os.path.dirname(sys.executable)) is None,
                    reason="the console script is not installed (pip install -e .)")
def test_console_script():
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "minisgl"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "serve" in r.stdout


def test_bad_option_value():
    r = run("serve", "--page-size", "0")
    assert r.returncode == 2 and "page_size: must be an int >= 1" in r.stderr
    r = run("serve", "--model", "/nonexistent/model")
    assert r.returncode == 2 and "model: '/nonexistent/model' not found" in r.stderr
    r = run("serve", "--sampling-defaults", '{"temperature": -1}')
    assert r.returncode == 2 and "sampling_defaults: temperature: must be >= 0" in r.stderr
    r = run("serve", "--cache", "lru")
    assert r.returncode == 2 and "invalid choice: 'lru'" in r.stderr


def _one_line_error(r, *wanted):
    "A refusal before anything starts: exit status 2, one line on stderr, no traceback."
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in wanted: assert w in lines[0], (w, lines[0])


def test_model_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    _one_line_error(run("serve", "--model", str(tmp_path)), "model:", "has no config.json")
    (tmp_path / "config.json").write_text("{}"); (tmp_path / "model.safetensors").unlink()
    _one_line_error(run("shell", "--model", str(tmp_path)), "has no *.safetensors")


def test_busy_port_fails_before_the_workers_start():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0)); busy.listen()
        t0 = time.monotonic()
        r = run("serve", "--port", str(busy.getsockname()[1]))
        took = time.monotonic() - t0
    _one_line_error(r, "port:", "is not free")
    assert "minisgl.engine" not in r.stderr and "kernel plan" not in r.stderr   # no model was loaded
    print(f"busy port refused in {took:.2f} s (interpreter and imports included)")


def test_shell_session():
    r = run("shell", "--max-tokens", "5", "--num-pages", "64", "--max-seq-len", "512", input="Hello there\n/reset\n/what\nAgain\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "minisgl shell" in r.stdout and "(conversation reset)" in r.stdout and "unknown command '/what'" in r.stdout
    assert r.stdout.count(">>> ") == 5


PROMPTS = ["Hello there, how are you today?", "A second prompt"]


@pytest.fixture(scope="module")
def offline_answer():
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    return [o.text for o in LLM(engine=toy_engine()()).generate(PROMPTS, SamplingParams(max_tokens=12))]


@pytest.fixture(scope="module")
def overlap_server():
    "Overlap scheduling and the naive cache, logging at info; the last test stops it with SIGINT."
    s = ServerProc("--overlap", "--cache", "naive", "--log-level", "info", toy=True)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def small_server():
    """One-token pages, chunked prefill of 4 tokens, one running request and one queued. Each step sleeps 5 ms, so
    that a 2000-token stream stays in flight ~10 s: the plain toy finishes it in ~0.7 s, and a loaded machine once
    let it finish before `test_queue_bound`'s next request arrived (200 instead of 429)."""
    s = ServerProc("--page-size", "1", "--prefill-budget", "4", "--step-delay", "0.005",
                   "--max-running-requests", "1", "--max-queued-requests", "1", toy=True)
    yield s
    assert s.stop() == 0


@pytest.mark.parametrize("which", ["overlap_server", "small_server"])
def test_serve_options_give_the_offline_answer(which, offline_answer, request):
    "Overlap scheduling, the naive cache, tiny pages and chunked prefill change how, not what, the server answers."
    s = request.getfixturevalue(which)
    r = httpx.post(s.base + "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == offline_answer
    assert httpx.get(s.base + "/debug/scheduler").json()["integrity"] == "ok"


def test_queue_bound(small_server):
    "One choice streaming, room for one more: a request for two choices gets 429 at once, then fits."
    s = small_server
    with httpx.stream("POST", s.base + "/v1/completions", timeout=30,
                      json={"prompt": "Hello", "max_tokens": 2000, "stream": True}) as r:
        assert r.status_code == 200
        busy = httpx.post(s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
        assert busy.status_code == 429
        err = busy.json()["error"]
        assert err["type"] == "rate_limit_error" and "max_queued_requests 1" in err["message"]
    for _ in range(50):      # the server notices the closed stream within a moment, then there is room again
        ok = httpx.post(s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2})
        if ok.status_code != 429: break
        time.sleep(0.1)
    assert ok.status_code == 200


def test_serve_says_where_it_listens(overlap_server):
    "uvicorn, handed a bound socket, names no address: the server says it once the model is ready."
    s = overlap_server
    assert f"serving the OpenAI API on http://127.0.0.1:{s.port}/v1" in s.output(), s.output()[-2000:]


def test_serve_stops_on_sigint(overlap_server):
    s = overlap_server
    assert s.seen_503 or s.startup_s < 1
    dbg = httpx.get(s.base + "/debug/scheduler").json()
    children, ipc_dir = s.children(), dbg["ipc_dir"]
    assert set(dbg["workers"].values()) <= set(children) and os.path.isdir(ipc_dir)
    with httpx.stream("POST", s.base + "/v1/completions", timeout=30,
                      json={"prompt": "Hello", "max_tokens": 2000, "stream": True}) as r:
        it = r.iter_lines()
        lines = [next(it)]
        s.proc.send_signal(signal.SIGINT)
        lines += [l for l in it if l]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert s.proc.wait(30) == 0, s.output()
    assert "Traceback" not in s.output(), s.output()
    assert not survivors(children), s.output()
    assert not os.path.exists(ipc_dir)
