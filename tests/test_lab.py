"""`make lab` (scripts/lab.sh) for real: JupyterLab on loopback runs the A/B/C chapter through its own server
(the REST contents and kernels API, then every code cell over the kernel's websocket channel), prints its URL
with the token, and Ctrl-C leaves nothing running; `jupyter nbconvert --execute` runs a chapter too."""
from __future__ import annotations

import ast
import asyncio
import json
import os
import pty
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import psutil
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from server_utils import ENV, free_port, survivors

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "03_continuous_batching.ipynb"      # the tutorial's worked example: A, B, C on two request slots
START_S, CELL_S, TEST_S = 120, 120, 300       # bounds against a hang (start-up, one cell, the whole test)


class Lab:
    "scripts/lab.sh in its own process group, stdin a terminal (as for a reader), its output collected."
    def __init__(self, tmp: Path, **env: str):
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.env = {**ENV, "PORT": str(self.port), "JUPYTER_TOKEN": self.token,
                    "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"), **env}
        self.runtime = Path(self.env["JUPYTER_RUNTIME_DIR"])
        self.lines: list[str] = []
        master, slave = pty.openpty()
        self.tty = master                            # held open until the end: the server's stdin is a terminal
        self.proc = subprocess.Popen([str(ROOT / "scripts" / "lab.sh")], cwd=ROOT, env=self.env, stdin=slave,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        os.close(slave)
        self.pgid = self.proc.pid                    # its own session: the group is the script's pid
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    @property
    def output(self) -> str: return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.output)):
            assert self.proc.poll() is None, f"lab.sh exited with {self.proc.returncode}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout} s:\n{self.output}"
            time.sleep(0.2)
        return m

    def api(self, method: str, path: str, body: dict | None = None, token: bool = True) -> tuple[int, dict | None]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}"} if token else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                data = r.read()
                return r.status, json.loads(data) if data and "json" in r.headers.get("Content-Type", "") else None
        except urllib.error.HTTPError as e:
            return e.code, None

    def stop(self):
        "What a reader's Ctrl-C does: SIGINT to the foreground process group."
        try: os.killpg(self.pgid, signal.SIGINT)
        except ProcessLookupError: pass
        try: self.proc.wait(60)
        finally:
            if self.proc.poll() is None: os.killpg(self.pgid, signal.SIGKILL); self.proc.wait(10)
            os.close(self.tty)


def in_group(pgid: int) -> list[int]:
    "Live processes of process group `pgid`."
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE: out.append(p.pid)
        except (ProcessLookupError, psutil.Error): pass
    return out


# --- one kernel over its websocket channel (Jupyter messaging protocol, JSON frames) ---

def _msg(session: str, code: str) -> dict:
    header = dict(msg_id=uuid.uuid4().hex, msg_type="execute_request", username="test", session=session,
                  date=datetime.now(timezone.utc).isoformat(), version="5.3")
    return dict(header=header, parent_header={}, metadata={}, channel="shell", buffers=[],
                content=dict(code=code, silent=False, store_history=True, user_expressions={}, allow_stdin=False,
                             stop_on_error=True))


async def _execute(ws, session: str, code: str, timeout: float) -> dict:
    "Runs `code`; its stdout, stderr, rich outputs (mime types -> data), error and reply status."
    msg = _msg(session, code)
    ws.write_message(json.dumps(msg))
    res = dict(stdout="", stderr="", data=[], error=None, status=None)
    idle, deadline = False, time.monotonic() + timeout
    while not (idle and res["status"]):
        raw = await asyncio.wait_for(ws.read_message(), max(deadline - time.monotonic(), 0.01))
        assert raw is not None, "the kernel's websocket closed"
        assert isinstance(raw, str), "a binary frame (a message with buffers): not expected from these cells"
        m = json.loads(raw)
        if m["parent_header"].get("msg_id") != msg["header"]["msg_id"]: continue
        kind, c = m["header"]["msg_type"], m["content"]
        if kind == "stream": res[c["name"]] += c["text"]
        elif kind in ("display_data", "execute_result"): res["data"].append(c["data"])
        elif kind == "error": res["error"] = f"{c['ename']}: {c['evalue']}\n" + re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(c["traceback"]))
        elif kind == "status": idle = c["execution_state"] == "idle"
        elif kind == "execute_reply": res["status"] = c["status"]
    return res


async def run_on_kernel(lab: Lab, kernel_id: str, codes: list[str], deadline: float) -> list[dict]:
    "Every code in order on the kernel, stopping at the first error."
    session = uuid.uuid4().hex
    url = f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels?session_id={session}"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {lab.token}"}, connect_timeout=30))
    out = []
    try:
        for code in codes:
            assert time.monotonic() < deadline, f"the whole test ran past {TEST_S} s"
            out.append(await _execute(ws, session, code, min(CELL_S, deadline - time.monotonic())))
            if out[-1]["error"] or out[-1]["status"] != "ok": break
    finally:
        ws.close()
    return out


# --- the A/B/C replay, read back from the chapter's own output ---

def worked_example(sources: list[str]) -> tuple[int, str, dict[str, tuple[int, int]]]:
    "The chapter's first `x, y = replay({name: (arrival, max_tokens)}, ...)` cell: its index, rows variable, scenario."
    for i, src in enumerate(sources):
        for node in ast.walk(ast.parse(src)):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "replay"
                    and node.value.args and isinstance(node.value.args[0], ast.Dict) and isinstance(node.targets[0], ast.Tuple)):
                return i, node.targets[0].elts[0].id, ast.literal_eval(node.value.args[0])
    raise AssertionError("no replay({...}) cell in the chapter")


def parse_table(text: str) -> list[dict]:
    "The round table that the chapter prints: header, then one line per round (columns two or more spaces apart)."
    lines = text.strip().splitlines()
    assert lines and lines[0].split()[:2] == ["round", "batch"] and "waiting" in lines[0], text
    rows = []
    for line in lines[1:]:
        f = re.split(r"\s{2,}", line.strip())
        rnd, batch, events, waiting = (f[0], f[1], f[2], f[3]) if len(f) == 4 else (f[0], f[1], "", f[2])
        phase, _, names = batch.partition(": ")
        parts = events.split("; ") if events else []
        tokens = dict((n, int(k)) for n, _, k in (t.split(" ") for t in parts[0].split(", "))) if parts and " token " in parts[0] else {}
        queue = re.findall(r"(\w+)(?: \(([^)]*)\))?", "" if waiting == "-" else waiting)   # "C (refused: slot), D"
        rows.append(dict(round=int(rnd), phase=None if batch == "-" else phase, reqs=names.split(", ") if names else [],
                         tokens=tokens, waiting=[n for n, _ in queue], notes={n: note for n, note in queue if note},
                         finished=[n for p in parts if p.endswith(" finished") for n in p[:-len(" finished")].split(", ")]))
    return rows


def check_replay(table: list[dict], scenario: dict[str, tuple[int, int]], slots: int):
    "What continuous batching promises for this scenario, checked on the table the run printed."
    assert sorted(scenario) == ["A", "B", "C"] and slots == 2, (scenario, slots)
    assert [r["round"] for r in table] == list(range(len(table)))
    for name, (arrival, max_tokens) in scenario.items():
        got = [(r["round"], r["tokens"][name]) for r in table if name in r["tokens"]]
        assert [k for _, k in got] == list(range(1, max_tokens + 1)), (name, got)       # one token a round it runs
        done = [r["round"] for r in table if name in r["finished"]]
        assert done == [got[-1][0]], (name, done)                                       # finishes once, at its last token
        first = next(r for r in table if name in r["reqs"])
        assert first["phase"] == "prefill" and first["round"] >= arrival, (name, first)
        assert all(name not in r["reqs"] for r in table if r["round"] > done[0])       # its slot is given up
    running = set()
    for r in table:
        assert len(r["reqs"]) <= slots, r
        running |= set(r["reqs"])
        assert len(running) <= slots, (r, running)                                      # never more than the slots
        for name in r["waiting"]: assert scenario[name][0] <= r["round"] and name not in r["reqs"], r
        running -= set(r["finished"])
    waited = {n for r in table for n in r["waiting"]}
    assert waited, "no request waited for a slot"
    for name in waited:                        # ... and got one only once another request had finished
        first = next(r["round"] for r in table if name in r["reqs"])
        assert any(r["finished"] for r in table if r["round"] < first), (name, table)


def test_lab_runs_the_chapter_and_stops_cleanly(tmp_path):
    deadline = time.monotonic() + TEST_S
    lab = Lab(tmp_path)
    try:
        # The one line a reader needs: the URL on loopback, with the token.
        m = lab.wait_for(r"\[lab\] .*?(http://127\.0\.0\.1:(\d+)/lab\?token=(\w+))", START_S)
        assert (int(m[2]), m[3]) == (lab.port, lab.token), m[0]
        assert lab.api("GET", "/api/status")[0] == 200
        assert lab.api("GET", "/api/status", token=False)[0] == 403
        with urllib.request.urlopen(m[1], timeout=30) as r: assert r.status == 200 and b"JupyterLab" in r.read()

        # Bound to loopback only: every listening socket of the server is on 127.0.0.1, and this machine's
        # other addresses (where it has any) refuse the port.
        server = psutil.Process(lab.proc.pid)
        assert "jupyter-lab" in " ".join(server.cmdline())        # lab.sh's shell became the server (exec)
        listening = {c.laddr for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        assert ("127.0.0.1", lab.port) in listening and {ip for ip, _ in listening} == {"127.0.0.1"}, listening
        others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not a.address.startswith("127.")]
        for ip in others:
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((ip, lab.port)) != 0, f"the lab answers on {ip}"

        # The chapter, as JupyterLab reads it (the contents API), on the kernel it names.
        status, model = lab.api("GET", f"/api/contents/{CHAPTER}?content=1&type=notebook")
        assert status == 200 and model["type"] == "notebook", status
        nb = nbformat.from_dict(model["content"])
        sources = [c.source for c in nb.cells if c.cell_type == "code"]
        assert len(sources) > 5
        status, spec = lab.api("GET", "/api/kernelspecs")
        assert status == 200 and spec["default"] == "python3" and "python3" in spec["kernelspecs"]
        status, kernel = lab.api("POST", "/api/kernels", {"name": "python3", "path": ""})
        assert status == 201, status

        idx, rows_var, scenario = worked_example(sources)
        sched_var = re.search(rf"{rows_var}\s*,\s*(\w+)\s*=\s*replay", sources[idx])[1]
        probe = ("import json as _j, os as _o, sys as _s\n"
                 f"print(_j.dumps(dict(prefix=_s.prefix, cwd=_o.getcwd(), pid=_o.getpid(), rows={rows_var},"
                 f" slots={sched_var}.config.max_running_reqs,"
                 " env={k: _o.environ.get(k) for k in ('HF_HUB_OFFLINE', 'TOKENIZERS_PARALLELISM')})))")
        results = asyncio.run(run_on_kernel(lab, kernel["id"], sources + [probe], deadline))
        for i, res in enumerate(results):
            assert res["error"] is None and res["status"] == "ok", f"cell {i} failed:\n{sources[i]}\n{res['error']}"
        assert len(results) == len(sources) + 1

        info = json.loads(results[-1]["stdout"])
        assert Path(info["prefix"]).resolve() == (ROOT / ".venv").resolve(), info["prefix"]   # .venv's Python
        assert Path(info["cwd"]).resolve() == (ROOT / "nbs").resolve()
        assert info["env"] == {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

        # The A/B/C replay's table, as printed in the run: it says what the scheduler did, and that is
        # continuous batching on two slots.
        table = parse_table(results[idx]["stdout"])
        keys = ("round", "phase", "reqs", "tokens", "waiting", "finished")
        assert [{k: r[k] for k in keys} for r in info["rows"]] == [{k: r[k] for k in keys} for r in table]
        for r, printed in zip(info["rows"], table):       # a note on a waiting request says why it was refused
            assert all(r.get("refused") and n == r["refused"][0] and str(r["refused"][1]) in note
                       for n, note in printed["notes"].items()), (r, printed)
        check_replay(table, scenario, info["slots"])
        assert any("image/png" in d for res in results for d in res["data"]), "no timeline drawn"

        # Shut the chapter's kernel down through the API; leave a second one for Ctrl-C to stop.
        assert info["pid"] in [p.pid for p in server.children(recursive=True)]
        assert lab.api("DELETE", f"/api/kernels/{kernel['id']}")[0] == 204
        assert lab.api("GET", "/api/kernels")[1] == []
        status, second = lab.api("POST", "/api/kernels", {"name": "python3"})
        assert status == 201, status
        assert asyncio.run(run_on_kernel(lab, second["id"], ["pass"], deadline))[0]["status"] == "ok"   # up and idle
        started = server.children(recursive=True)
        assert started, "no kernel process for the second kernel"
    except BaseException:
        print(lab.output[-6000:])
        raise
    finally:
        lab.stop()
    assert lab.proc.returncode == 0, (lab.proc.returncode, lab.output[-3000:])         # Ctrl-C: a clean stop
    assert survivors([info["pid"], *(p.pid for p in started)]) == []
    assert in_group(lab.pgid) == []
    assert not [p.name for p in lab.runtime.glob("*") if p.name.startswith(("kernel-", "jpserver-"))]


def test_lab_refuses_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0)); busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([str(ROOT / "scripts" / "lab.sh")], cwd=ROOT, env={**ENV, "PORT": str(port)},
                           capture_output=True, text=True, timeout=START_S, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and f"port {port} on 127.0.0.1 is in use" in r.stderr, r.stderr


def test_nbconvert_executes_a_chapter(tmp_path):
    src = ROOT / "nbs" / "00a_messages.ipynb"
    before = src.read_bytes()
    r = subprocess.run([str(Path(sys.executable).with_name("jupyter")), "nbconvert", "--to", "notebook", "--execute",
                        "--ExecutePreprocessor.timeout=120", "--output-dir", str(tmp_path), str(src)],
                       cwd=ROOT, env={**ENV, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_PATH": str(ROOT / ".venv/share/jupyter")},
                       capture_output=True, text=True, timeout=TEST_S)
    assert r.returncode == 0, r.stderr[-3000:]
    nb = nbformat.read(tmp_path / src.name, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code)                 # every cell ran
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert any(o.output_type == "execute_result" for c in code for o in c.outputs)
    assert src.read_bytes() == before                                    # the chapter itself is untouched
