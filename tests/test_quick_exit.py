"""A supervised process that fails on an uncaught exception ends without the interpreter's last
full garbage collections (worker/quick_exit.py), and loses nothing Python runs at exit: the
atexit handlers run, and a reference cycle made unreachable before the error is finalized."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from harness import CHILDREN, child_env, events, launch

PROBE = str(CHILDREN / "quick_exit_probe.py")


@pytest.mark.slow
@pytest.mark.parametrize("hook", ["checkpointer", "exit-record"])
def test_a_failing_supervised_process_freezes_what_is_left_after_one_collection(tmp_path, hook):
    """Through either of rtrain's excepthooks: a Checkpointer's, or install_excepthook's."""
    out = tmp_path / "out"
    out.mkdir()
    r = launch(tmp_path / "run", "--no-standby", PROBE, str(out), hook, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c["failure"] for c in events(tmp_path / "run", "classification")] == ["crash"]
    failed = json.loads((out / "attempt-0.json").read_text())
    # The atexit handler ran after the excepthook's freeze, and the cycle, unreachable
    # before the error, was collected by the one full collection first.
    assert failed["freeze_count"] > 1000 and failed["cycle_finalized"], failed
    ended = json.loads((out / "attempt-1.json").read_text())
    assert ended == {"cycle_finalized": False, "freeze_count": 0}, ended  # a good end: as ever


@pytest.mark.slow
def test_an_unsupervised_failing_process_ends_as_python_ends_it(tmp_path):
    r = subprocess.run([sys.executable, PROBE, str(tmp_path)], env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the probe fails its first attempt" in r.stderr, r.stderr
    assert json.loads((tmp_path / "attempt-0.json").read_text()) == {
        "cycle_finalized": False, "freeze_count": 0}
