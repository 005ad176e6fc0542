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
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
