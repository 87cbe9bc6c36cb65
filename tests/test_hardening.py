"""No request can hurt the server: hostile values, strict JSON types, malformed bodies, limits, access control,
a fault in one request's path, and a worker killed under load. On the `ToyEngine` (tests/toy_serve.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from server_utils import ServerProc, children_of, survivors

HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def toy():
    "A toy server with a small KV pool (128 tokens), a 4 MiB body limit, a short body timeout and a faulty seed."
    s = ServerProc("--num-pages", "8", "--page-size", "16", "--max-seq-len", "2048", "--max-request-bytes", str(4 << 20),
                   "--body-timeout", "1", "--faulty-seed", "666", toy=True)
    yield s
    assert s.stop() == 0, s.output()


HTTP = httpx.Client(timeout=60)   # kept alive: a new client per request costs ~40 ms (its TLS context)


def post(s, path, body, **kw):
    if isinstance(body, (bytes, str)): return HTTP.post(s.base + path, content=body, headers=kw.pop("headers", HEADERS), **kw)
    return HTTP.post(s.base + path, json=body, **kw)


def assert_healthy(s):
    "Alive, answering, and every KV page given back."
    assert httpx.get(s.base + "/health").status_code == 200
    r = post(s, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    for _ in range(50):
        dbg = httpx.get(s.base + "/debug/scheduler").json()
        if dbg["pages_owned"] == 0 and dbg["running"] == 0: break
        time.sleep(0.1)
    assert dbg["integrity"] == "ok" and dbg["pages_owned"] == 0, dbg


def openai_error(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and len(err["message"]) < 400, err
    if param is not None: assert err["param"] == param, err
    return err


# -------------------------------------------------------------- values that used to stop the server
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"prompt": "Hi", "temperature": 1, "top_k": 9223372036854775808}, 400, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "temperature": 1, "top_k": 2**62, "max_tokens": 3}, 200, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 1, "top_p": 1e-300, "max_tokens": 3}, 200, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": 1e-300, "max_tokens": 3}, 200, None),
    ("/v1/completions", '{"prompt": "\\udc80"}', 400, "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, "messages.0.content"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\udc80"]}', 400, "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi", "name": "\\udc80"}]}', 400, "messages.0.name"),
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
])
def test_hostile_values(toy, path, body, status, param):
    r = post(toy, path, body)
    if status == 200: assert r.status_code == 200, r.text
    else: openai_error(r, status, param)
    assert_healthy(toy)


# -------------------------------------------------------------- strict JSON types
@pytest.mark.parametrize("body,param", [
    ('{"prompt": "a", "max_tokens": "1"}', "max_tokens"), ('{"prompt": "a", "temperature": true}', "temperature"),
    ('{"prompt": "a", "stream": "1"}', "stream"), ('{"prompt": [[false]]}', "prompt"), ('{"prompt": "a", "n": 1.0}', "n"),
    ('{"prompt": "a", "temperature": NaN}', None), ('{"prompt": "a", "temperature": Infinity}', None),
])
def test_strict_json_types(toy, body, param):
    openai_error(post(toy, "/v1/completions", body), 400, param)


# -------------------------------------------------------------- client mistakes are 4xx, never 500
def test_client_mistakes_are_4xx(toy):
    openai_error(post(toy, "/v1/completions", b'\xff\xfe{"prompt": "a"}'), 400)
    openai_error(post(toy, "/v1/completions", b"[" * 50_000 + b"]" * 50_000), 400)
    openai_error(post(toy, "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"), 400)
    err = openai_error(post(toy, "/v1/completions", '{"prompt": "a", "' + "k" * 100_000 + '": 1}'), 400)
    assert "unknown field" in err["message"] and len(err["param"]) <= 100    # named, never echoed whole
    r = post(toy, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 100_000})
    openai_error(r, 400, "messages")                                        # too long for the context: 400
    err = openai_error(post(toy, "/v1/completions", {"prompt": "a " * 1_000_000}), 400, "prompt")
    assert "characters" in err["message"]                                   # refused before tokenizing: no stall
    err = openai_error(post(toy, "/v1/completions", {"prompt": "Hi", "max_tokens": 500}), 400, "max_tokens")
    assert "pool" in err["message"]                                         # can never fit the KV pool: 400, not 429
    openai_error(httpx.get(toy.base + "/v1/nothing"), 404)
    openai_error(httpx.get(toy.base + "/v1/completions"), 405)
    openai_error(post(toy, "/v1/completions", b'{"prompt": "Hi"}', headers={"content-type": "text/plain"}), 415)
    assert_healthy(toy)


# -------------------------------------------------------------- limits
def test_body_size_limit(toy):
    t = time.monotonic()
    err = openai_error(post(toy, "/v1/completions", b'{"prompt": "' + b"a" * (8 << 20) + b'"}'), 413)
    assert "max-request-bytes" in err["message"] and time.monotonic() - t < 10
    assert_healthy(toy)


def test_slow_body_is_dropped(toy):
    "A client that sends half its body and stops gets 408 after --body-timeout, and the server serves the others meanwhile."
    host, port = "127.0.0.1", toy.port
    with socket.create_connection((host, port), timeout=10) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"prompt\"")
        assert post(toy, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200
        reply = c.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 408"), reply[:200]


def test_request_timeout():
    s = ServerProc("--request-timeout", "0.3", toy=True)
    try:
        err = openai_error(post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 1900, "ignore_eos": True}), 504)
        assert "request-timeout" in err["message"]
        with httpx.stream("POST", s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1900, "stream": True,
                                                                    "ignore_eos": True}, timeout=30) as r:
            lines = [l for l in r.iter_lines() if l]
        assert "data: [DONE]" not in lines and json.loads(lines[-1][6:])["error"]["code"] == "request_timeout"
        assert_healthy(s)
    finally:
        assert s.stop() == 0, s.output()


# -------------------------------------------------------------- access control
def test_api_key():
    s = ServerProc("--api-key", "s3cret", "--allowed-origins", "https://ok.example", toy=True)
    try:
        openai_error(post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), 401)
        openai_error(post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers={"authorization": "Bearer nope"}), 401)
        openai_error(httpx.get(s.base + "/v1/models"), 401)
        ok = httpx.post(s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and httpx.get(s.base + "/health").status_code == 200
        assert httpx.get(s.base + "/docs").status_code == 404           # no page that loads a CDN's assets
        r = httpx.options(s.base + "/v1/completions", headers={"origin": "https://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in r.headers          # CORS: only the origins allowed
        r = httpx.options(s.base + "/v1/completions", headers={"origin": "https://ok.example", "access-control-request-method": "POST"})
        assert r.headers.get("access-control-allow-origin") == "https://ok.example"
    finally:
        assert s.stop() == 0, s.output()


def test_defaults_are_closed():
    "No debug route, no CORS, no /docs unless asked for."
    s = ServerProc(toy=True, debug=False)
    try:
        assert httpx.get(s.base + "/debug/scheduler").status_code == 404
        r = httpx.options(s.base + "/v1/completions", headers={"origin": "https://evil.example", "access-control-request-method": "POST"})
        assert "access-control-allow-origin" not in r.headers
        spec = httpx.get(s.base + "/openapi.json").json()            # the request bodies are described, for fuzzers
        assert "requestBody" in spec["paths"]["/v1/completions"]["post"]
    finally: assert s.stop() == 0


# -------------------------------------------------------------- defence in depth
def test_fault_in_one_request_fails_it_alone(toy):
    "The engine raises whenever the seed-666 request is in the batch: it gets a 500, the others batched with it are served."
    results = {}
    def run(i, seed):
        results[i] = post(toy, "/v1/completions", {"prompt": f"Hello {i}", "max_tokens": 8, "temperature": 1, "seed": seed})
    threads = [threading.Thread(target=run, args=(i, 666 if i == 2 else i)) for i in range(5)]
    for t in threads: t.start()
    for t in threads: t.join()
    err = openai_error(results[2], 500)
    assert "injected fault" in err["message"] and err["type"] == "internal_error"
    assert all(results[i].status_code == 200 and results[i].json()["usage"]["completion_tokens"] == 8 for i in (0, 1, 3, 4))
    with httpx.stream("POST", toy.base + "/v1/completions", json={"prompt": "Hi", "seed": 666, "stream": True}, timeout=30) as r:
        lines = [l for l in r.iter_lines() if l]
    assert "data: [DONE]" not in lines and "injected fault" in json.loads(lines[-1][6:])["error"]["message"]
    assert_healthy(toy)


# -------------------------------------------------------------- a worker killed under load
@pytest.mark.parametrize("worker", ["minisgl-scheduler", "minisgl-tokenizer"])
def test_killed_worker_fails_every_request_and_the_server_exits(worker):
    s = ServerProc("--step-delay", "0.005", toy=True)   # 1900 tokens take ~10 s: in flight when the worker dies
    dbg = httpx.get(s.base + "/debug/scheduler").json()
    pid, children = dbg["workers"][worker], s.children()
    got: dict[str, object] = {}
    opened = threading.Event()
    def plain():
        got["plain"] = httpx.post(s.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1900, "ignore_eos": True, "n": 4},
                                  timeout=60)
    def stream():
        with httpx.stream("POST", s.base + "/v1/completions", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines(); first = next(lines); opened.set()
            got["stream"] = [l for l in [first, *lines] if l]
    threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
    for t in threads: t.start()
    assert opened.wait(60)
    wait_running(s, 2)           # the stream and a choice of the other request are in flight
    os.kill(pid, signal.SIGKILL)
    t0, health = time.monotonic(), None
    while health is None and time.monotonic() - t0 < 5:      # /health turns 503 at once (or the server is already gone)
        try: code = httpx.get(s.base + "/health", timeout=2).status_code
        except httpx.TransportError: code = 0
        if code in (0, 503): health = code
        time.sleep(0.05)
    assert health in (0, 503)
    for t in threads: t.join(30)
    assert got["plain"].status_code == 503, got["plain"].text
    assert got["plain"].json()["error"]["type"] == "service_unavailable"
    assert "data: [DONE]" not in got["stream"] and "error" in json.loads(got["stream"][-1][6:])
    assert s.proc.wait(15) == 1, s.output()                                  # the server exits, non-zero
    assert time.monotonic() - t0 < 15
    assert not survivors(children), s.output()
    s.stop()


def test_stalled_scheduler_is_detected_and_recovers():
    "SIGSTOP the scheduler with a request in flight: /health turns 503, the request ends at its timeout; SIGCONT heals."
    s = ServerProc("--watchdog-timeout", "1", "--request-timeout", "3", "--step-delay", "0.005", toy=True)
    try:
        pid = httpx.get(s.base + "/debug/scheduler").json()["workers"]["minisgl-scheduler"]
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("r", post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 1900,
                                                                                         "ignore_eos": True})))
        t.start(); wait_running(s, 1)
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            while httpx.get(s.base + "/health").status_code == 200:
                assert time.monotonic() - t0 < 5, "the watchdog did not notice"
                time.sleep(0.1)
            assert httpx.get(s.base + "/health").json()["status"] == "stalled"
            openai_error(post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}), 503)
            t.join(10)
            openai_error(got["r"], 504)
            time.sleep(1.5)                          # stopped for longer than the request's whole life
        finally:
            os.kill(pid, signal.SIGCONT)
        t0 = time.monotonic()
        while httpx.get(s.base + "/health").status_code != 200:
            assert time.monotonic() - t0 < 10, "no recovery after SIGCONT"
            time.sleep(0.1)
        assert_healthy(s)
    finally:
        assert s.stop() == 0, s.output()


def test_workers_and_sockets_end_with_a_killed_server():
    s = ServerProc(toy=True)
    dbg = httpx.get(s.base + "/debug/scheduler").json()
    workers, ipc_dir = list(dbg["workers"].values()), dbg["ipc_dir"]
    os.kill(s.proc.pid, signal.SIGKILL)                # the main process alone, as an OOM killer would
    s.proc.wait(10)
    assert not survivors(workers, grace_s=10)
    t0 = time.monotonic()
    while os.path.exists(ipc_dir) and time.monotonic() - t0 < 10: time.sleep(0.1)
    assert not os.path.exists(ipc_dir)
    s.stop()


# -------------------------------------------------------------- what held before and must keep holding
def wait_running(s, n: int):
    "Until the scheduler runs `n` requests (so that what follows strikes requests in flight)."
    t0 = time.monotonic()
    while httpx.get(s.base + "/debug/scheduler").json()["running"] < n:
        assert time.monotonic() - t0 < 60, f"{n} requests never ran"
        time.sleep(0.05)


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try: total += int(next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS")).split()[1])
        except (OSError, StopIteration): pass
    return total / 1024


def test_many_streams_an_abort_storm_and_steady_memory():
    "128 concurrent streams all complete; 100 clients that hang up mid-stream leave no page owned; 500 requests do not grow the server."
    import asyncio
    s = ServerProc(toy=True)
    try:
        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256, max_keepalive_connections=0)) as c:
                async def stream(i):
                    async with c.stream("POST", s.base + "/v1/completions",
                                        json={"prompt": f"Hi {i}", "max_tokens": 16, "ignore_eos": True, "stream": True}) as r:
                        return [l async for l in r.aiter_lines() if l][-1] == "data: [DONE]"
                assert all(await asyncio.gather(*(stream(i) for i in range(128))))
                async def hang_up(i):
                    async with c.stream("POST", s.base + "/v1/completions",
                                        json={"prompt": f"Go {i}", "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
                        async for _ in r.aiter_lines(): break
                await asyncio.gather(*(hang_up(i) for i in range(100)))
                async def plain(i):
                    r = await c.post(s.base + "/v1/completions", json={"prompt": f"Count {i % 7}", "max_tokens": 4})
                    assert r.status_code == 200
                for i in range(100): await plain(i)            # warm
                pids = [s.proc.pid, *s.children()]
                before = rss_mb(pids)
                for k in range(5): await asyncio.gather(*(plain(100 * k + i) for i in range(100)))
                return before, rss_mb(pids)
        before, after = asyncio.run(main())
        print(f"server RSS {before:.0f} MB -> {after:.0f} MB after 500 requests")
        assert after - before < 50, (before, after)
        assert_healthy(s)
    finally:
        assert s.stop() == 0, s.output()


def test_sigterm_with_16_open_streams():
    "SIGTERM under load: every open stream ends (finish_reason abort, then [DONE]), the server exits 0, nothing is left."
    s = ServerProc(toy=True)
    dbg = httpx.get(s.base + "/debug/scheduler").json()
    children, ipc_dir, ends, open_ = s.children(), dbg["ipc_dir"], {}, threading.Semaphore(0)
    def stream(i):
        with httpx.stream("POST", s.base + "/v1/completions", timeout=60,
                          json={"prompt": f"Go {i}", "max_tokens": 1900, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            got = [next(lines)]; open_.release()                  # this stream is open and streaming
            ends[i] = [l for l in [*got, *lines] if l][-2:]
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(16)]
    for t in threads: t.start()
    for _ in threads: assert open_.acquire(timeout=60)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads: t.join(30)
    assert len(ends) == 16 and all(e[-1] == "data: [DONE]" for e in ends.values()), ends
    assert all(json.loads(e[0][6:])["choices"][0]["finish_reason"] in ("abort", "length") for e in ends.values())
    assert s.proc.wait(30) == 0, s.output()
    assert not survivors(children) and not os.path.exists(ipc_dir)
    s.stop()


def test_api_key_from_the_environment(monkeypatch):
    from minisgl.server import ServerArgs
    monkeypatch.setenv("MINISGL_API_KEY", "from-env")
    assert ServerArgs().api_key == "from-env" and ServerArgs(api_key="given").api_key == "given"
    monkeypatch.delenv("MINISGL_API_KEY")
    assert ServerArgs().api_key is None
