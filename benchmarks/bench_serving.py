"""`minisgl serve` under concurrent streaming clients, against llama.cpp's `llama-server --parallel N` on the same
GGUF: output tok/s, time to first token and inter-token latency (p50/p99) at several concurrencies.

Each run starts a server on a free loopback port (the embedded model with `minisgl serve`'s defaults, bf16 where its
bf16 kernels run; llama-server with `--parallel` equal
to the concurrency and a context of 1024 tokens per slot), sends `--requests` completions of random-word prompts
of 40-300 words with `--new-tokens` new tokens each (EOS ignored), at most `--concurrency` at a time, streaming,
and measures on the client: TTFT = first streamed token - request sent; ITL = the gaps between a request's
streamed chunks. The server is stopped after each run. The client is a small one of our own (httpx, asyncio):
NVIDIA's aiperf (PyPI) installs and runs offline against a running server (`aiperf profile --endpoint-type
completions --streaming --concurrency 16 --tokenizer <the converted model directory> ...`), but its worker
processes took 13.4 s of CPU in a 21 s run at concurrency 16, against 0.55 s for this client, so on a 2-core
machine it takes a third of the cores from the server it measures: use it where cores are spare.
`--peer-url` measures an already running OpenAI-compatible server the same way. On a CPU with AMX the run is repeated
as a CPU without it (`bench_workload.run_capped`: oneDNN capped below AMX, minisgl's AMX kernel off; the servers
inherit the caps), its JSON next to `--out` as `.capped.json`.

llama-server is not on PyPI: build it once per machine from the llama.cpp vendored in llama-cpp-python's sdist
(`pip download --no-binary :all: --no-deps llama-cpp-python`, then `cmake -B build -DLLAMA_BUILD_SERVER=ON
-DLLAMA_CURL=OFF ...` and `cmake --build build --target llama-server`; see the closing note of issue 13).

    .venv/bin/python benchmarks/bench_serving.py --concurrency 1,4,16,64 --llama-server /path/to/llama-server --out s.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

WORDS = ("time people year way day thing man world life hand part child eye woman place work week case point "
         "number group problem fact water room mother area money story month lot right study book job word "
         "business issue side kind head house service friend father power hour game line end member law car city").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 300))) for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, prompt: str, new: int) -> dict:
    body = {"model": "default", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter(); stamps = []
    # a connection per request: llama-server closes kept-alive connections that the client would then reuse
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600, headers={"Connection": "close"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"): stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def load(url: str, ps: list[str], conc: int, new: int) -> dict:
    sem = asyncio.Semaphore(conc)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=conc + 4)) as client:
        async def guarded(p):
            async with sem: return await one(client, url, p, new)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(p) for p in ps))
        wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in res); itl = sorted(g for r in res for g in r["itl"])
    q = lambda xs, f: xs[min(len(xs) - 1, int(f * len(xs)))]
    # EOS is ignored, so every request streams exactly `new` tokens (a chunk may carry more than one)
    return dict(concurrency=conc, requests=len(ps), output_tok_s=new * len(ps) / wall,
                ttft_p50=statistics.median(ttft), ttft_p99=q(ttft, 0.99), itl_p50=statistics.median(itl), itl_p99=q(itl, 0.99))


def start_server(policy: str, port: int, extra: list[str], llama_server: str | None = None, conc: int = 1) -> subprocess.Popen:
    if policy == "llama-server":
        from minisgl.weights import default_gguf_path
        cmd = [llama_server, "-m", str(default_gguf_path()), "--port", str(port), "--host", "127.0.0.1",
               "--parallel", str(conc), "-c", str(1024 * conc), "--threads", str(os.cpu_count())]
    else:
        cmd = [sys.executable, "-m", "minisgl", "serve", "--port", str(port), "--schedule-policy", policy, "--log-level", "warning", *extra]
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_serving_{policy}_{port}.log"), "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)   # the server's log, kept for a failed run
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200: return p
        except httpx.HTTPError: pass
        if p.poll() is not None: raise RuntimeError(f"the server exited with {p.returncode}")
        time.sleep(0.5)
    p.terminate(); raise RuntimeError("the server did not become healthy in 150 s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--policies", default="mixed,prefill_first",
                    help="minisgl scheduling policies to run, comma-separated (serve's default is mixed)")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also run this llama-server binary (same GGUF)")
    ap.add_argument("--server-args", default="", help="extra `minisgl serve` options, e.g. '--prefill-budget 512'")
    ap.add_argument("--peer-url", default=None, help="also measure this running OpenAI-compatible server")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-cap-run", action="store_true", help="on an AMX CPU, skip the run capped below AMX (oneDNN and minisgl)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_workload import banner, machine, run_capped
    info = machine()
    print(banner(info))
    print(f"{args.requests} requests per run, 40-300-word prompts, {args.new_tokens} new tokens")
    print("| system | concurrency | output tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms |\n|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    targets = [(f"minisgl {p}", p) for p in args.policies.split(",") if p]
    targets += ([("llama-server", "llama-server")] if args.llama_server else []) + ([("peer", None)] if args.peer_url else [])
    for seed, conc in enumerate(int(c) for c in args.concurrency.split(",")):
        ps = prompts(args.requests, seed)   # the same prompts for every system at this concurrency
        for name, policy in targets:
            server = (start_server(policy, port := free_port(), args.server_args.split(), args.llama_server, conc)
                      if policy else None)
            try:
                url = f"http://127.0.0.1:{port}" if policy else args.peer_url
                r = asyncio.run(load(url, ps, conc, args.new_tokens))
            finally:
                if server: server.terminate(); server.wait(30)
            rows.append({"system": name, **r})
            print(f"| {name} | {conc} | {r['output_tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
                  f"{r['itl_p50'] * 1e3:.0f} | {r['itl_p99'] * 1e3:.0f} |", flush=True)
    if args.out:
        with open(args.out, "w") as f: json.dump(dict(machine=info, args=vars(args), rows=rows), f, indent=1)
    run_capped(__file__, args, info)   # the servers inherit the caps


if __name__ == "__main__":
    main()
