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

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

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


FEATURE_FOLDERS = ("standby", "timelimit", "pressure", "elsewhere", "hooks", "retention", "mirror",
                   "straggler")


def _contract(name_start: str) -> dict:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in contracts["contracts"] if c["name"].startswith(name_start)]
    return contract


def _held(module: str, expressions: list[str]) -> bool:
    """Whether a module is one of the expressions or inside one (`*`: any one name)."""
    parts = module.split(".")
    return any(len(e.split(".")) <= len(parts)
               and all(x in ("*", p) for x, p in zip(e.split("."), parts[:len(e.split("."))],
                                                     strict=True)) for e in expressions)


def _modules(folder: str) -> set[str]:
    return {f"rtrain.supervisor.{folder}.{p.stem}"
            for p in (ROOT / "supervisor" / folder).glob("*.py") if p.stem != "__init__"}


def test_every_feature_module_is_a_decision_or_forbidden_to_decisions():
    pure = _contract("Pure decisions")
    undeclared = sorted(m for folder in FEATURE_FOLDERS for m in _modules(folder)
                        if _held(m, pure["source_modules"]) == _held(m, pure["forbidden_modules"]))
    assert not undeclared, f"name these in the purity contract, as decision or process side: " \
        f"{undeclared}"


def test_every_mirror_module_is_its_transfer_core_or_named_glue():
    mirror = _contract("The mirror")
    glue = {m for m in mirror["forbidden_modules"] if m.startswith("rtrain.supervisor.mirror.")}
    assert set(mirror["source_modules"]) | glue == _modules("mirror")
    assert not set(mirror["source_modules"]) & glue
