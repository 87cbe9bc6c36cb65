#!/usr/bin/env bash
# Opens the chapters (nbs/) in JupyterLab: sets up .venv if needed, then serves JupyterLab on
# 127.0.0.1 only, with .venv's Python as the notebooks' kernel, and prints the URL with its token.
# PORT=8899 picks the port (default 8888, or a free one when 8888 is taken); JUPYTER_TOKEN=... fixes
# the token (default: a fresh random one). Extra arguments go to `jupyter lab`. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
PY=.venv/bin/python

# Is 127.0.0.1:$1 free? (SO_REUSEADDR as in the server: a port in TIME_WAIT counts as free.)
port_free() {
  "$PY" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError: sys.exit(1)' "$1"
}
if [ -n "${PORT:-}" ]; then
  if ! port_free "$PORT"; then
    echo "[lab] port $PORT on 127.0.0.1 is in use: choose another one, e.g. PORT=$((PORT + 1)) make lab" >&2
    exit 1
  fi
else
  PORT=8888
  if ! port_free "$PORT"; then
    PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "[lab] port 8888 is in use: using $PORT instead"
  fi
fi

# The token travels in the environment, not on the command line (where `ps` would show it).
export JUPYTER_TOKEN=${JUPYTER_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_hex(24))')}
# What the notebooks expect (as in scripts/test.sh); .venv's kernelspec first, so that the "python3"
# kernel the chapters name is .venv's Python even where a user-wide python3 kernelspec exists.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PATH="$PWD/.venv/bin:$PATH" JUPYTER_PATH="$PWD/.venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
URL="http://127.0.0.1:$PORT/lab?token=$JUPYTER_TOKEN"
root=(); if [ "$(id -u)" = 0 ]; then root=(--allow-root); fi   # containers often run as root

# Print the URL once the server answers (in the background: the server below takes this shell's
# place, so that Ctrl-C reaches it directly and stops it with its kernels).
(
  "$PY" - "$PORT" "$$" <<'PY'
import os, sys, time, urllib.request
port, server = sys.argv[1], int(sys.argv[2])
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/status",
                             headers={"Authorization": "token " + os.environ["JUPYTER_TOKEN"]})
while True:
    try: os.kill(server, 0)
    except OSError: sys.exit(1)                  # the server is gone: it has said why
    try:
        with urllib.request.urlopen(req, timeout=2): sys.exit(0)
    except OSError: time.sleep(0.3)
PY
  echo "[lab] the chapters are open at $URL   (Ctrl-C stops JupyterLab)"
) &

exec .venv/bin/jupyter lab --no-browser --ip=127.0.0.1 --port="$PORT" --ServerApp.port_retries=0 \
  --ServerApp.root_dir="$PWD/nbs" --ServerApp.answer_yes=True \
  --LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate ${root[@]+"${root[@]}"} "$@"
