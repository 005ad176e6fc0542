"""The layer contracts of `[tool.importlinter]` in pyproject.toml hold: no torch in the
supervisor or in the worker's entry points, pure decisions without process code, the checkpoint
format below both halves, the worker apart from the supervisor's loop and CLI. Each contract
says there why it exists."""

from __future__ import annotations

from pathlib import Path

from importlinter import configuration
from importlinter.application import use_cases

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
