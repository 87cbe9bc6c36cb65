#!/usr/bin/env bash
# Builds the documentation site into docs/ (open docs/index.html): nbdev processes the notebooks in
# nbs/, Sphinx + myst-nb + furo render them (Quarto, which nbdev_docs wants, is not needed).
# Offline and idempotent; extra arguments go to scripts/build_docs.py (e.g. --out /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if [ ! -x "$PY" ]; then scripts/setup_env.sh; fi
if ! "$PY" -c "import sphinx, myst_nb, furo" 2>/dev/null; then
  echo "[docs] sphinx, myst-nb or furo missing from .venv: running scripts/setup_env.sh" >&2
  scripts/setup_env.sh
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYDEVD_DISABLE_FILE_VALIDATION=1
exec "$PY" scripts/build_docs.py "$@"
