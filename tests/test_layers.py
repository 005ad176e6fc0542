"""The layer contracts of `[tool.importlinter]` in pyproject.toml hold: no torch in the
supervisor or in the worker's entry points, pure decisions without process code, the checkpoint
format below both halves, the worker apart from the supervisor's loop and CLI, the worker's
folders below the Checkpointer and saving below restoring. Each contract says there why it
exists.

They are checked on the package as it ships: the wheel's `rtrain` folder, which holds the
checkout's `supervisor/`, `worker/` and `checkpoint/` as `rtrain/supervisor/`, `rtrain/worker/`
and `rtrain/checkpoint/` (setup.py). import-linter reads a package from one folder, so it cannot
follow an editable install's mapping of four."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_import_contracts_are_kept_by_the_package_as_it_ships(shipped, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(shipped.wheel) as z:
        z.extractall(site)
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                       cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)},
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "0 broken" in r.stdout
    # Every module of the package was read (the count adds the external modules it imports).
    analyzed = int(re.search(r"Analyzed (\d+) files", r.stdout)[1])
    assert analyzed > len(list((site / "rtrain").rglob("*.py")))
