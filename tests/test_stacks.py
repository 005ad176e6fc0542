"""Stacks of a hung attempt (supervisor/proc/stacks.py): whatever py-spy does to the process it
reads, the process runs again afterwards (a stopped process cannot serve the save at a hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rtrain.supervisor.proc.stacks import dump_stacks

# What py-spy does at its worst: its ptrace attach stops the target, and it dies (killed at the
# dump's timeout) before resuming it.
STOPPING_PYSPY = """#!/bin/sh
kill -STOP "$3"
echo "attached to $3"
exec sleep 60
"""


def _status(pid: int) -> str:
    return psutil.Process(pid).status()


@pytest.mark.slow
@pytest.mark.parametrize("was_stopped", [False, True])
def test_a_process_py_spy_left_stopped_runs_again(tmp_path, monkeypatch, was_stopped):
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(STOPPING_PYSPY)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        if was_stopped:  # stopped before the dump (a user's SIGSTOP): left as it was found
            child.send_signal(signal.SIGSTOP)
            deadline = time.monotonic() + 5
            while _status(child.pid) != psutil.STATUS_STOPPED:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        files = dump_stacks([child.pid], tmp_path, signal.SIGUSR2, timeout_s=1.0)
        assert files == [tmp_path / f"stacks-pyspy-{child.pid}.txt"]
        assert "attached" in files[0].read_text()
        time.sleep(0.2)
        expected = psutil.STATUS_STOPPED if was_stopped else psutil.STATUS_SLEEPING
        assert _status(child.pid) == expected
    finally:
        child.kill()
        child.wait()
