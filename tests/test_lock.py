"""The run-dir lock, against a real second process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness import REPO

from rtrain.supervisor.core.errors import AlreadySupervised, ExitCode
from rtrain.supervisor.records.lock import LOCK_NAME, RunLock

HOLDER = """
import sys, time
from rtrain.supervisor.records.lock import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()  # hold until the test closes our stdin
"""


@pytest.fixture
def holder(tmp_path):
    run_dir = tmp_path / "run 'dir'"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "locked\n"  # blocks until the lock is held
        yield run_dir, proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_second_supervisor_is_refused_naming_the_pid(holder):
    run_dir, proc = holder
    with pytest.raises(AlreadySupervised) as err:
        RunLock(run_dir).acquire()
    message = str(err.value)
    assert f"already supervised by rtrain pid {proc.pid}" in message
    assert "stop it or use another --run-dir" in message and "started " in message
    assert err.value.exit_code == ExitCode.ALREADY_SUPERVISED


@pytest.mark.slow
def test_lock_is_free_once_the_holder_exits(holder):
    run_dir, proc = holder
    proc.stdin.close()
    proc.wait(timeout=30)
    with RunLock(run_dir) as lock:
        info = json.loads((run_dir / LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
        assert lock.previous is None  # the holder cleared its name on a clean release


def test_stale_lock_of_a_dead_pid_is_taken_over(tmp_path):
    dead = int(Path("/proc/sys/kernel/pid_max").read_text())  # no process has this pid
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                  "started": 1.0}))
    with RunLock(tmp_path) as lock:
        assert lock.previous["pid"] == dead and lock.previous["alive"] is False
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    with RunLock(tmp_path):  # released: a second acquire in turn works
        pass


ORPHANING_HOLDER = """
import os, subprocess, sys
from rtrain.supervisor.records.lock import RunLock
RunLock(sys.argv[1]).acquire()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], close_fds=False,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
os._exit(0)  # a supervisor that dies without releasing, its child still running
"""


@pytest.mark.slow
def test_lock_fd_is_not_inherited_by_the_training_child(tmp_path):
    out = subprocess.run([sys.executable, "-c", ORPHANING_HOLDER, str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    orphan = int(out)
    try:
        # Were the descriptor inherited, the orphaned child would still hold the flock.
        with RunLock(tmp_path) as lock:
            assert lock.previous is not None and lock.previous["alive"] is False
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)
