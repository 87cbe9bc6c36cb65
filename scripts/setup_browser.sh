#!/usr/bin/env bash
# Makes sure a Chromium is installed for tests/test_site_browser.py (the documentation site in a real
# browser): Debian's chromium package, driven by Playwright from .venv. Playwright's own browser
# download (`playwright install`) is never used. Safe to run again: nothing to do once it is there.
# Where it cannot install (no apt-get, not root), it says so and the browser test skips (fails under CI).
set -uo pipefail
for c in "${CHROMIUM:-}" /usr/bin/chromium; do
  if [ -n "$c" ] && [ -x "$c" ]; then exit 0; fi
done
if command -v chromium >/dev/null 2>&1; then exit 0; fi

say() { echo "[browser] $*" >&2; }
if ! command -v apt-get >/dev/null 2>&1; then
  say "no chromium and no apt-get here: install Chromium (or set CHROMIUM=/path/to/chromium) to run tests/test_site_browser.py"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  say "no chromium, and installing it needs root: run 'sudo apt-get install -y chromium' to run tests/test_site_browser.py"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
say "installing Debian's chromium (once) for tests/test_site_browser.py"
if ! apt-get install -y -q chromium >/dev/null 2>&1; then  # the package lists may be missing or stale
  apt-get update -q >/dev/null && apt-get install -y -q chromium | tail -n 3
fi
if [ -x /usr/bin/chromium ]; then say "ready: $(/usr/bin/chromium --version 2>/dev/null)"
else say "could not install chromium with apt-get: tests/test_site_browser.py will skip (or fail under CI)"; fi
exit 0
