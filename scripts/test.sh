#!/usr/bin/env bash
# The whole test suite, from a fresh clone: set-up, then the nbdev checks, every notebook, pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -x -k radix).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
scripts/setup_browser.sh   # Chromium for tests/test_site_browser.py
export PATH="$PWD/.venv/bin:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$SECONDS

# Kernel plans measured during the tests are timed while two notebooks run at once, so they would be poor plans
# to keep: the run gets a cache of its own, which sees the converted models of the user's cache (as
# links) but keeps its plans to itself; the next `make serve` measures its plan on a quiet machine.
user_cache="${MINISGL_CACHE:-$HOME/.cache/minisgl}"
MINISGL_CACHE="$(mktemp -d "${TMPDIR:-/tmp}/minisgl-test-cache.XXXXXX")"
export MINISGL_CACHE
trap 'rm -rf "$MINISGL_CACHE"' EXIT
for d in "$user_cache"/*/; do
  if [ -f "${d}source.json" ]; then ln -s "${d%/}" "$MINISGL_CACHE/"; fi
done

echo "== 1/3 the notebooks are the source: cleaning and exporting them must change nothing"
snapshot() { git status --porcelain -- nbs minisgl; git diff -- nbs minisgl | sha1sum; }
before=$(snapshot)
nbdev_clean >/dev/null
nbdev_export
python scripts/render_readme.py --check
after=$(snapshot)
if [ "$before" != "$after" ]; then
  echo "FAIL: nbdev_clean/nbdev_export changed files; edit the notebooks, export, and commit both:" >&2
  git status --porcelain -- nbs minisgl >&2
  exit 1
fi

echo "== 2/3 every notebook runs on this machine (cells flagged gpu run only with --flags gpu)"
flags=""
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then flags="--flags gpu"; fi
# shellcheck disable=SC2086
nbdev_test --n_workers 2 --timing $flags

echo "== 3/3 pytest tests/ (tests/test_kernels.py also compiles every CUDA source with nvcc)"
python -m pytest tests/ -q -p no:cacheprovider --durations=30 "$@"
echo "all tests passed in $((SECONDS - start)) s (after set-up)"
