"""A process re-parented to rtrain (proc/adopted.py) is waited for like one it spawned: its
exit status, a signal as a negative status, a timeout, and one reaped elsewhere."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from rtrain.supervisor.proc.adopted import Adopted
from rtrain.supervisor.proc.reaper import _own
from rtrain.supervisor.proc.spawn import become_subreaper

pytestmark = pytest.mark.slow


def _orphan(code: str) -> int:
    """A grandchild whose parent exits at once: re-parented to us (a subreaper)."""
    become_subreaper()
    out = subprocess.run(["sh", "-c", f"sh -c '{code}' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True).stdout
    return int(out)


def test_an_adopted_child_is_waited_for_like_a_spawned_one():
    pid = _orphan("sleep 0.3; exit 3")
    proc = Adopted(pid)
    assert proc in _own  # the orphan reaper leaves its status to it
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.01)
    assert proc.wait(10) == 3 and proc.returncode == 3
    assert proc.poll() == 3


def test_a_signal_is_a_negative_status_and_one_reaped_elsewhere_is_ended():
    killed = Adopted(_orphan("sleep 60"))
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(10) == -signal.SIGKILL
    other = Adopted(_orphan("sleep 0.2; exit 0"))
    os.waitpid(other.pid, 0)  # someone else got its status
    assert other.wait(1) == 0
