"""Replicas behind a router: two `minisgl serve` processes (the real default model) on loopback and SGLang's router
(`python -m sglang_router.launch_router`, from PyPI, unmodified) in front, driven by the official `openai` client.

One set of processes for the module (starting them is most of its time). The tests run in file order: requests spread
over both replicas, requests that share a prefix stay on one, then a replica is killed and the router routes around it,
and finally shutdown leaves nothing running.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from server_utils import ENV, ServerProc, free_port, survivors

MODEL = "SmolLM2-135M-Instruct"
PAGES, CONTEXT, RUNNING = 256, 512, 8
SERVE = ("--dtype", "float32", "--device", "cpu", "--num-pages", str(PAGES), "--max-seq-len", str(CONTEXT),
         "--max-running-requests", str(RUNNING), "--num-threads", "1")     # a core each: replicas share the machine
N = 4          # tokens per answer


class RouterProc:
    "SGLang's router on a free loopback port in front of `replicas`; returns once it has registered every one as healthy."
    def __init__(self, replicas: list[ServerProc], policy: str, timeout: float = 60):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *[r.base for r in replicas],
             "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),   # its own metrics: not the default 29000
             "--health-check-interval-secs", "1", "--shutdown-grace-period-secs", "5", "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.healthy() != {r.base for r in replicas}:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the router did not register the replicas:\n{self.output()}")
            time.sleep(0.2)

    def workers(self) -> list[dict]:
        "The router's view of its workers (its `/workers` route)."
        try: return httpx.get(self.base + "/workers", timeout=5).json()["workers"]
        except (httpx.TransportError, ValueError, KeyError): return []

    def healthy(self) -> set[str]:
        return {w["url"] for w in self.workers() if w["is_healthy"]}

    def output(self) -> str:
        p = Path(self.log.name)
        return p.read_text() if p.exists() else ""

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try: self.proc.wait(30)
            except subprocess.TimeoutExpired: os.killpg(self.proc.pid, signal.SIGKILL); self.proc.wait(10)
        if not self.log.closed:
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def served(replica: ServerProc) -> int:
    "Generation requests this replica answered with 200, from its `/metrics`."
    text = httpx.get(replica.base + "/metrics", timeout=10).text
    return round(sum(float(v) for v in re.findall(r'^minisgl_requests_total\{endpoint="\w+",status="200"\} (\S+)$', text, re.M)))


def prefix_hits(replica: ServerProc) -> int:
    "Prompt tokens this replica served from its prefix cache."
    text = httpx.get(replica.base + "/metrics", timeout=10).text
    return round(float(re.search(r"^minisgl_prefix_cache_hit_tokens (\S+)$", text, re.M).group(1)))


@pytest.fixture(scope="module")
def cluster():
    with ThreadPoolExecutor(2) as ex:                  # the two replicas load the model at the same time
        futures = [ex.submit(ServerProc, *SERVE) for _ in range(2)]
    replicas, errors = [], []
    for f in futures:
        try: replicas.append(f.result())
        except Exception as e: errors.append(e)
    routers: dict[str, RouterProc] = {}
    try:
        if errors: raise errors[0]
        pids = [p for r in replicas for p in (r.proc.pid, *r.children())]
        routers = {policy: RouterProc(replicas, policy) for policy in ("round_robin", "cache_aware")}
        yield dict(replicas=replicas, routers=routers, pids=pids + [r.proc.pid for r in routers.values()])
    finally:
        for r in routers.values(): r.stop()
        for r in replicas: r.stop()


def client(router: RouterProc) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(router: RouterProc, prompt: str, **kw) -> str:
    r = client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, **kw)
    assert r.choices[0].finish_reason in ("length", "stop") and 0 < r.usage.completion_tokens <= N, r
    return r.choices[0].text


def test_worker_routes(cluster):
    "What the router reads from a replica: its name and limits, its load, and a one-token health check."
    base = cluster["replicas"][0].base
    info = httpx.get(base + "/server_info").json()
    assert (info["served_model_name"], info["max_running_requests"], info["max_total_tokens"]) == (MODEL, RUNNING, PAGES * 16)
    assert info["max_seq_len"] == CONTEXT and "api_key" not in info
    assert httpx.get(base + "/get_server_info").json() == info
    assert httpx.get(base + "/model_info").json()["is_generation"] is True
    load = httpx.get(base + "/get_load").json()
    assert [sorted(x) for x in load] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]]
    assert httpx.get(base + "/health_generate", timeout=60).json() == {"status": "ok"}


def test_router_knows_the_model(cluster):
    "The router names its workers' model after their `/server_info`, and lists it."
    router = cluster["routers"]["round_robin"]
    assert {w["model_id"] for w in router.workers()} == {MODEL}
    assert [m.id for m in client(router).models.list().data] == [MODEL]


def test_requests_spread_over_replicas(cluster):
    "A dozen requests through the round-robin router (completions, streams, chats): every answer right, both replicas serve."
    router, replicas = cluster["routers"]["round_robin"], cluster["replicas"]
    prompt = "The capital of France is"
    direct = openai.OpenAI(base_url=replicas[0].base + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0).choices[0].text
    before = [served(r) for r in replicas]
    texts = [complete(router, prompt) for _ in range(6)]
    for _ in range(2):
        stream = client(router).completions.create(model=MODEL, prompt=prompt, max_tokens=N, temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in stream if c.choices))
    for _ in range(4):
        r = client(router).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                                                   max_tokens=N, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens == N
    assert texts == [want] * 8, texts            # greedy fp32: the same answer from either replica
    served_here = [served(r) - b for r, b in zip(replicas, before)]
    print("requests per replica:", served_here)
    assert sum(served_here) == 12 and min(served_here) > 0, served_here


def test_cache_aware_keeps_a_prefix_on_one_replica(cluster):
    "Requests that share a long prefix go where that prefix is cached: one replica serves them all, from its radix cache."
    router, replicas = cluster["routers"]["cache_aware"], cluster["replicas"]
    shared = "You are a terse assistant. Answer every question in one word, without punctuation or explanation. " * 3
    before, hits = [served(r) for r in replicas], [prefix_hits(r) for r in replicas]
    for i in range(4): complete(router, shared + f"Question {i}: what is {i} plus {i}?")
    served_here = [served(r) - b for r, b in zip(replicas, before)]
    hits_here = [prefix_hits(r) - h for r, h in zip(replicas, hits)]
    print("requests per replica:", served_here, "prefix-cache hit tokens:", hits_here)
    assert sorted(served_here) == [0, 4], served_here
    assert hits_here[served_here.index(4)] > 0


def test_dead_replica_is_routed_around(cluster):
    "SIGKILL one replica: requests through the router keep succeeding, on the other; the dead one's workers exit by themselves."
    router, (alive, dead) = cluster["routers"]["round_robin"], cluster["replicas"]
    workers = dead.children()
    os.kill(dead.proc.pid, signal.SIGKILL)              # the server process alone, as an OOM killer would
    dead.proc.wait(10)
    before = served(alive)
    for i in range(4): complete(router, f"Count to {i}:")        # at once: the router retries a failed send on the other
    deadline = time.monotonic() + 60
    while dead.base in router.healthy():                # its health checks (every second) mark the replica down
        assert time.monotonic() < deadline, router.workers()
        time.sleep(0.2)
    for i in range(4): complete(router, f"Count to {i}:")
    assert served(alive) - before == 8
    assert not survivors(workers, grace_s=10)


def test_shutdown_leaves_nothing_running(cluster):
    "The routers and the live replica stop cleanly (exit status 0), and no process of the module is left."
    for r in cluster["routers"].values(): assert r.stop() == 0, r.output()
    alive = cluster["replicas"][0]
    assert alive.stop() == 0, alive.output()
    assert not survivors(cluster["pids"], grace_s=10)
