#!/usr/bin/env bash
# Install rtrain with its test dependencies into .venv and run the whole suite (lint + tests).
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# The CPU build of torch, pinned: an open range could pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check --config-settings editable_mode=compat -e '.[dev]'
# The report test opens a page in headless Chromium (Debian's package); it skips without one.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
    >/dev/null 2>&1 || echo "note: could not install chromium; the report test will skip" >&2
fi
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
