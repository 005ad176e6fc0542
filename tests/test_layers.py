"""The layer contracts of `[tool.importlinter]` in pyproject.toml hold: no torch in the
supervisor or in the worker's entry points, pure decisions without process code, the checkpoint
format below both halves, the worker apart from the supervisor's loop and CLI. Each contract
says there why it exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def test_import_contracts_are_kept():
    # --no-cache: nothing is written into the checkout.
    r = subprocess.run([str(LINT_IMPORTS), "--no-cache", "--config", "pyproject.toml"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
