"""rtrain as PID 1 of its own PID namespace, as a container's entrypoint runs: it adopts every
orphan below it and must reap them, and SIGTERM (what the kubelet sends) must reach it, since
the kernel drops a signal to PID 1 that has no handler. The stop saves, rtrain exits 75, and
nothing of the run is left in the namespace."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from harness import CHILDREN, REPO, child_env, events

pytestmark = pytest.mark.slow

ORPHANS = 5


def _unshare_works() -> str | None:
    """None when `unshare --pid --fork --mount-proc` runs here, else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"unshare --pid --fork --mount-proc fails here: {r.stderr.strip()[:200]}"
    return None


def _pid_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _in_namespace(ns: str) -> list[int]:
    return [p.pid for p in psutil.process_iter() if _pid_ns(p.pid) == ns]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:  # a zombie has none
        return []


def _zombies(proc: psutil.Process) -> list[int]:
    out = []
    for p in proc.children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_rtrain_as_pid_1_reaps_orphans_and_stops_on_sigterm_with_a_checkpoint(tmp_path):
    why = _unshare_works()
    if why:
        print(f"skipping: {why}")
        pytest.skip(why)
    run, ckpts = tmp_path / "run", tmp_path / "ckpts"
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--", sys.executable,
           "-m", "rtrain", "launch", "--run-dir", str(run), "-q", "--no-backoff",
           str(CHILDREN / "orphans_then_train.py"), str(ckpts), "1000", str(ORPHANS)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (init := psutil.Process(proc.pid).children()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        rtrain = init[0]
        nspid = re.search(r"^NSpid:\s*(.*)$", Path(f"/proc/{rtrain.pid}/status").read_text(),
                          re.MULTILINE)
        assert nspid and nspid.group(1).split()[-1] == "1", "rtrain is not PID 1 of its namespace"
        ns = _pid_ns(rtrain.pid)
        assert ns is not None and ns != _pid_ns(os.getpid())

        log = run / "attempts" / "0" / "stdout.log"
        while "step 10\n" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        # The orphans were adopted by PID 1 (the sleeping one is still its child) and exited
        # about 1 s ago; rtrain waits for them at its next sample (every second).
        script = str(CHILDREN / "orphans_then_train.py")
        # The warm standby for the next attempt names the script too: not one of these.
        adopted = [p for p in rtrain.children()
                   if script in _cmdline(p)
                   and not any(a.endswith("standby/child_program.py") for a in _cmdline(p))]
        assert len(adopted) == 2, "want the training process and the sleeping orphan"
        settle = time.monotonic() + 5
        while (zombies := _zombies(rtrain)) and time.monotonic() < settle:
            time.sleep(0.1)
        assert zombies == [], f"PID 1 left {len(zombies)} zombies unreaped"

        os.kill(rtrain.pid, signal.SIGTERM)  # what the kubelet does to a pod's PID 1
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()  # --kill-child: PID 1 dies with unshare and takes the rest along
            proc.wait()
    assert proc.returncode == 75, err[-3000:]
    steps = [int(m) for m in re.findall(r"^step (\d+)$", log.read_text(), re.MULTILINE)]
    assert (ckpts / f"checkpoint-{steps[-1]}" / "manifest.json").exists(), \
        "no checkpoint at the step the stop ended"
    assert [e["name"] for e in events(run, "signal")] == ["SIGTERM"]
    assert events(run, "exit")[0]["returncode"] == 75  # the child saved and exited 75 itself
    assert events(run, "classification")[0]["failure"] == "preempted"
    # PID 1's exit ends its namespace: nothing of the run is left anywhere.
    assert _in_namespace(ns) == []
