"Helpers for the end-to-end tests: start `python -m minisgl serve` on a free loopback port, stop it, inspect its processes."
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _test_toy(seed: int | None, step_delay: float, **kw):
    """A `ToyEngine` whose forward raises whenever a request seeded `seed` is in the batch (a fault in one request's
    path), and sleeps `step_delay` seconds first (so that a long request stays in flight long enough to be struck:
    the plain toy runs 1900 tokens in about a second, quicker than a loaded machine polls /debug/scheduler)."""
    from minisgl.scheduler import ToyEngine

    class TestToy(ToyEngine):
        def forward_batch(self, batch):
            if step_delay: time.sleep(step_delay)
            if seed is not None and any(r.sampling_params.seed == seed for r in batch.reqs): raise RuntimeError("injected fault")
            return super().forward_batch(batch)
    return TestToy(**kw)


def toy_engine(args=None, faulty_seed: int | None = None, step_delay: float = 0.0):
    "A picklable factory of the scheduler chapter's `ToyEngine`, sized like the default model (vocabulary, EOS) and `args`."
    from functools import partial
    from minisgl.engine import EngineArgs
    from minisgl.scheduler import SchedulerConfig, ToyEngine
    from minisgl.weights import load_tokenizer
    args, tok = args or EngineArgs(), load_tokenizer()
    seq, rows = args.max_seq_len or 2048, args.max_running_reqs or SchedulerConfig().max_running_reqs
    pages = args.num_pages or -(-(rows + 1) * seq // args.page_size)      # every slot can fill its context
    kw = dict(num_pages=pages, page_size=args.page_size, max_seq_len=seq, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id])
    if faulty_seed is None and not step_delay: return partial(ToyEngine, **kw)
    return partial(_test_toy, faulty_seed, step_delay, **kw)


class ServerProc:
    "A `minisgl serve` subprocess on loopback (`toy`: on the `ToyEngine`, through tests/toy_serve.py)."
    def __init__(self, *args: str, timeout: float = 240, toy: bool = False, debug: bool = True):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self._output = ""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="minisgl-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, str(Path(__file__).with_name("toy_serve.py"))] if toy else [sys.executable, "-m", "minisgl", "serve"]
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port),
                                      "--log-level", "warning", *(["--debug-routes"] if debug else []), *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        t0, seen_503 = time.monotonic(), False
        while True:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.base + "/health", timeout=2)
                if r.status_code == 200: break
                assert r.status_code == 503, r.text
                seen_503 = True
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                self.kill()
                raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")
            time.sleep(0.2)
        self.startup_s, self.seen_503 = time.monotonic() - t0, seen_503

    def output(self) -> str:
        p = Path(self.log.name)
        return p.read_text() if p.exists() else self._output

    def _close_log(self):
        "The server has exited: keep its output in memory, remove the log file."
        self._output = self.output()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def children(self) -> list[int]:
        return children_of(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try: self.proc.wait(timeout)
            except subprocess.TimeoutExpired: self.kill()
        self._close_log()
        return self.proc.returncode

    def kill(self):
        try: os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError: pass
        self.proc.wait(10)
        self._close_log()


def children_of(pid: int) -> list[int]:
    "Direct children of `pid` (from /proc)."
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try: fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError: continue
        if int(fields[1]) == pid: out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def survivors(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """The processes among `pids` still alive after `grace_s` seconds.

    multiprocessing's resource tracker (one of the server's children) exits only once the last process
    holding its pipe is gone, a moment after the server itself: give it a short grace period."""
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline: time.sleep(0.1)
    return left
