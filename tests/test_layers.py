"""The layer contracts of `[tool.importlinter]` in pyproject.toml hold: no torch in the
supervisor or in the worker's entry points, pure decisions without process code, the checkpoint
format below both halves, the worker apart from the supervisor's loop and CLI. Each contract
says there why it exists."""

from __future__ import annotations

import sys
from pathlib import Path

from importlinter import configuration
from importlinter.application import use_cases

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    configuration.configure()  # what the lint-imports command does first
    # cache_dir=None: nothing is written into the checkout.
    passed = use_cases.lint_imports(config_filename=str(ROOT / "pyproject.toml"), cache_dir=None,
                                    no_logo=True)
    out = capsys.readouterr().out
    assert passed, out[-4000:]
    assert "0 broken" in out


def test_every_worker_unit_is_held_to_not_importing_the_checkpointer():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (units,) = [c["source_modules"] for c in contracts["contracts"]
                if c["forbidden_modules"] == ["worker.checkpointer"]]
    modules = {f"worker.{p.stem}" for p in (ROOT / "worker").glob("*.py")
               if p.stem not in ("__init__", "checkpointer")}
    assert set(units) == modules
