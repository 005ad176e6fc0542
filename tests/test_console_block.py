"""A console that does not read must never freeze `rtrain launch` (real pipes, real signals).

`rtrain launch train.py | sleep 600`, a paused pager, `| head -c 300`: the echo to the console is
best effort; the attempt's log files keep everything, stop signals still work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from harness import CHILDREN, child_env, launch_cmd

from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.records.runstate import load_state

CHATTY = CHILDREN / "chatty.py"

pytestmark = pytest.mark.slow


def _cmd(run: Path, *child: str) -> list[str]:
    # No -q: the child's output is echoed to our stdout, the pipe under test.
    return launch_cmd(run, str(CHATTY), *child, quiet=False)


def _wait_step(run: Path, step: int, timeout: float = 60) -> None:
    log = run / "attempts" / "0" / "stdout.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and f"step {step} ".encode() in log.read_bytes():
            return
        time.sleep(0.05)
    pytest.fail(f"the child never reached step {step}: rtrain is blocked on its console")


def _decisions(run: Path) -> list[str]:
    return [e["action"] for e in read_events(run / "events.jsonl") if e["kind"] == "decision"]


def test_stop_works_while_nobody_reads_the_console(tmp_path):
    run = tmp_path / "run"
    r, w = os.pipe()  # `| sleep 600`: the read end stays open, nobody reads
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(_cmd(run, "1000000", "1024", "0.001"), env=child_env(),
                                cwd=tmp_path, stdout=w, stderr=err)
    os.close(w)
    try:
        # 600 lines of 1 KiB are far past a pipe's 64 KiB and what rtrain holds back.
        _wait_step(run, 600)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75, (tmp_path / "stderr").read_text()
        assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(r)
    assert _decisions(run) == ["exit_preempted"]
    assert load_state(run).status.value == "preempted"
    assert b"stop requested at step" in (run / "attempts" / "0" / "stdout.log").read_bytes()


def test_a_console_closed_early_does_not_stop_training(tmp_path):
    run = tmp_path / "run"
    head = subprocess.Popen(["head", "-c", "300"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL)
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(_cmd(run, "400", "200", "0.002"), env=child_env(), cwd=tmp_path,
                                stdout=head.stdin, stderr=err)
    head.stdin.close()
    try:
        assert proc.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        head.wait(timeout=10)
    assert _decisions(run) == ["finished"]
    assert load_state(run).status.value == "finished"
    log = (run / "attempts" / "0" / "stdout.log").read_bytes()
    assert log.endswith(b"step 400 " + b"x" * 190 + b"\ndone\n")
    assert "Traceback" not in (tmp_path / "stderr").read_text()


def test_a_console_that_pauses_is_told_what_it_missed(tmp_path):
    run = tmp_path / "run"
    r, w = os.pipe()
    got = bytearray()
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(_cmd(run, "1000000", "1024", "0.001"), env=child_env(),
                                cwd=tmp_path, stdout=w, stderr=err)
    os.close(w)

    def read_all() -> None:
        while chunk := os.read(r, 65536):
            got.extend(chunk)

    try:
        _wait_step(run, 600)  # a paused pager: nothing read meanwhile
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        deadline = time.monotonic() + 30
        while b"lines not echoed" not in got and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75, (tmp_path / "stderr").read_text()
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(r)
    note = f"lines not echoed (the console was too slow), see {run}/attempts/0/]".encode()
    assert note in got
    # What was echoed is the log's content, in order, up to the gap.
    log = (run / "attempts" / "0" / "stdout.log").read_bytes()
    before_gap = bytes(got[: got.index(b"\n[rtrain: ")])
    assert log.startswith(before_gap)


def test_stop_works_while_the_terminal_is_not_read(tmp_path):
    # A terminal nobody reads (a paused pager, a stalled ssh session): a real pty whose master
    # side is never read; rtrain's stdout and stderr (with the live status line) go there.
    run = tmp_path / "run"
    master, slave = os.openpty()
    proc = subprocess.Popen(_cmd(run, "1000000", "1024", "0.001"), env=child_env(), cwd=tmp_path,
                            stdout=slave, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    try:
        _wait_step(run, 600)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert _decisions(run) == ["exit_preempted"]
