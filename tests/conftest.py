"""Helpers for tests that run real child processes (tests/children/*.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil
import pytest

from supervisor.spawn import ChildSpec

CHILDREN = Path(__file__).parent / "children"


def child_spec(tmp_path: Path, script: str, *args: str, **kw) -> ChildSpec:
    env = dict(os.environ)
    env.update(kw.pop("env", {}))
    return ChildSpec(
        argv=[sys.executable, str(CHILDREN / script), *args],
        env=env,
        cwd=CHILDREN,
        attempt_dir=tmp_path / "attempts" / "0",
        **kw,
    )


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once `pid` no longer runs (a zombie counts as gone), waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def wait_for(path: Path, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return path.read_text()
