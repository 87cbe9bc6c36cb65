"""The attention bodies an engine runs (nbs/08_engine.ipynb): timed once per machine and kept in the plan cache, so
engines that start together, or one after another, run the same body (each body rounds in its own order, and a
server should give the same bits as an offline `LLM` beside it); a damaged or stale file is timed anew; engines
starting at the same moment time once, through the lock file; `kernels='measure'` (`fresh`) times anew."""
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import minisgl.engine as engine_mod
from minisgl import kernels
from minisgl.engine import Engine, EngineConfig, attention_times, attention_times_file, choose_attention_bodies
from minisgl.kernels import attention_bodies, attention_body, use_attention_body
from minisgl.models import ModelConfig
from minisgl.weights import load_hf_config, resolve_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(kernels.native() is None, reason="minisgl._C not built")
CFG = ModelConfig.from_hf(load_hf_config(resolve_model(None, progress=False, weights=False)))
GROUP = CFG.num_heads // CFG.num_kv_heads
KINDS = ("decode", "extend")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A plan cache without attention times (the converted models linked in, the kernel plans copied: neither is what
    is tested); the bodies the flags choose run again afterwards (a test may leave another one running)."""
    import shutil
    from minisgl.linear import plan_cache_dir
    from minisgl.weights import cache_root
    for p in cache_root().glob("*"):
        if p.is_dir() and (p / "source.json").exists(): (tmp_path / p.name).symlink_to(p)
    (tmp_path / "kernel-plans").mkdir()
    for p in plan_cache_dir().glob("plan-*.json"): shutil.copy(p, tmp_path / "kernel-plans")
    monkeypatch.setenv("MINISGL_CACHE", str(tmp_path))
    yield tmp_path
    for kind in KINDS:
        for dtype in (torch.float32, torch.bfloat16): use_attention_body(kind, dtype, CFG.head_dim, GROUP, None)


def _bodies(dtype=torch.bfloat16):
    return {kind: attention_bodies(kind, dtype, CFG.head_dim, GROUP) for kind in KINDS}


def _count_timing(monkeypatch, ms=lambda kind, bodies: {b: 1.0 + i for i, b in enumerate(bodies)}, pause=0.0):
    "Replace the timing by made-up figures (the flags' body fastest unless `ms` says otherwise); the calls are counted."
    calls = []
    def fake(kind, dtype, head_dim, num_heads, num_kv_heads, reps=5):
        calls.append(kind); time.sleep(pause)
        return ms(kind, attention_bodies(kind, dtype, head_dim, num_heads // num_kv_heads))
    monkeypatch.setattr(engine_mod, "time_attention_bodies", fake)
    return calls


def test_timed_once_then_read_back(cache, monkeypatch):
    "The first call times both kinds for real and saves them; the next reads the file (timing would fail) and keeps the same bodies."
    first = choose_attention_bodies(CFG, torch.bfloat16)
    path = attention_times_file(CFG, torch.bfloat16)
    assert [c.kind for c in first] == list(KINDS) and all(c.source == "measured" for c in first)
    saved = json.loads(path.read_text())
    assert {kind: list(ms) for kind, ms in saved.items()} == _bodies()
    assert all(0 < t < 1e3 for ms in saved.values() for t in ms.values())
    def no_timing(*a, **k): raise AssertionError("timed again although the times were kept")
    monkeypatch.setattr(engine_mod, "time_attention_bodies", no_timing)
    again = choose_attention_bodies(CFG, torch.bfloat16)
    assert all(c.source == f"cache {path}" for c in again)
    assert [(c.kind, c.ms, c.body) for c in again] == [(c.kind, c.ms, c.body) for c in first]
    for c in again: assert attention_body(c.kind, torch.bfloat16, CFG.head_dim, GROUP) == c.body


def test_the_kept_times_decide(cache, monkeypatch):
    """Times in the file that make the last body the fastest by far: it is the one that runs (the figures, not a
    fresh timing, decide); a file without one of the bodies that run here, or damaged, is timed anew and replaced."""
    bodies = _bodies()
    if any(len(names) < 2 for names in bodies.values()): pytest.skip("one attention body runs here: nothing to choose")
    calls = _count_timing(monkeypatch)
    path = attention_times_file(CFG, torch.bfloat16)
    path.write_text(json.dumps({kind: {b: (0.1 if b == names[-1] else 1.0) for b in names} for kind, names in bodies.items()}))
    choices = choose_attention_bodies(CFG, torch.bfloat16)
    assert calls == [] and [c.body for c in choices] == [bodies[k][-1] for k in KINDS]
    for kind in KINDS: assert attention_body(kind, torch.bfloat16, CFG.head_dim, GROUP) == bodies[kind][-1]
    for bad in ("{not json", json.dumps({kind: {names[0]: 1.0} for kind, names in bodies.items()}),   # a body missing
                json.dumps({kind: {b: -1.0 for b in names} for kind, names in bodies.items()})):       # nonsense times
        path.write_text(bad); calls.clear()
        times, source = attention_times(CFG, torch.bfloat16)
        assert calls == list(KINDS) and source == "measured" and {k: list(v) for k, v in times.items()} == bodies
        assert json.loads(path.read_text()) == times   # replaced
    calls.clear()
    assert attention_times(CFG, torch.bfloat16, fresh=True)[1] == "measured" and calls == list(KINDS)   # kernels='measure'


def test_engines_starting_together_time_once(cache, monkeypatch):
    "Two engines' choices started at the same moment: one times (slowly), the other waits on the lock and reads its figures."
    calls = _count_timing(monkeypatch, pause=0.5)
    got = []
    threads = [threading.Thread(target=lambda: got.append(attention_times(CFG, torch.bfloat16))) for _ in range(2)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert calls == list(KINDS)   # once for each kind, not twice
    assert sorted(source.split()[0] for _, source in got) == ["cache", "measured"] and got[0][0] == got[1][0]


def test_processes_starting_together_run_the_same_bodies(cache):
    """Two processes that start at once, both timing for real (the noisy case a server beside an offline `LLM` hit):
    one times, the other reads the times it kept, and both run the same bodies."""
    code = ("import json, torch; from minisgl.engine import choose_attention_bodies; from minisgl.models import ModelConfig; "
            "from minisgl.weights import load_hf_config, resolve_model; "
            "cfg = ModelConfig.from_hf(load_hf_config(resolve_model(None, progress=False, weights=False))); "
            "print(json.dumps([[c.kind, c.body, c.ms, c.source] for c in choose_attention_bodies(cfg, torch.float32)]))")
    env = {**os.environ, "MINISGL_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    runs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert [[k, b, ms] for k, b, ms, _ in runs[0]] == [[k, b, ms] for k, b, ms, _ in runs[1]]
    assert sorted(run[0][3].split()[0] for run in runs) == ["cache", "measured"]


def test_engine_runs_the_kept_body_and_says_so(cache, monkeypatch, caplog):
    "An engine follows the kept times and logs where they came from; `kernels='measure'` times them anew."
    import logging
    bodies = _bodies(torch.float32)
    calls = _count_timing(monkeypatch, ms=lambda kind, names: {b: (0.1 if b == names[-1] else 1.0) for b in names})
    cfg = EngineConfig(model=None, dtype="float32", device="cpu", num_pages=32, max_seq_len=128, quantization="none")
    with caplog.at_level(logging.INFO, logger="minisgl.engine"):
        eng = Engine(cfg, progress=False)
    try:
        assert calls == list(KINDS) and "attention bodies (times of a busy step of these heads, measured)" in caplog.text
        assert [c.body for c in eng.attention_choices] == [bodies[k][-1] for k in KINDS]
    finally: eng.close()
    caplog.clear(); calls.clear()
    with caplog.at_level(logging.INFO, logger="minisgl.engine"):
        eng = Engine(cfg, progress=False)
    try:
        assert calls == [] and f"cache {attention_times_file(eng.model.cfg, torch.float32)}" in caplog.text
        assert [c.body for c in eng.attention_choices] == [bodies[k][-1] for k in KINDS]
    finally: eng.close()
