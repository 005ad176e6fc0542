"""A full disk under the run dir must not stop training or supervision (a real small tmpfs).

The attempt's log and events.jsonl are best effort while the disk is full: what cannot be
written is counted (the log says how much is missing) or held (events, state.json) until there
is room; the run's end is recorded once the ballast is gone.
"""

from __future__ import annotations

import errno
import subprocess
import time
from pathlib import Path

import pytest
from harness import CHILDREN, child_env, launch_cmd

from supervisor.records.events import read_events
from supervisor.records.runstate import load_state

pytestmark = pytest.mark.slow


def _start(tmp_path: Path, run: Path, *child: str) -> subprocess.Popen:
    # Events every half second: some are due while the disk is full.
    (tmp_path / "rtrain.toml").write_text("summary_every_s = 0.5\n")
    return subprocess.Popen(launch_cmd(run, *child), env=child_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "wb"))


def _fill(disk: Path) -> Path:
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return ballast


def _wait_text(path: Path, text: bytes, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_bytes():
            return
        time.sleep(0.05)
    pytest.fail(f"{text!r} never appeared in {path}")


def test_training_goes_on_through_a_full_disk(tmp_path, small_tmpfs):
    run = small_tmpfs("8m") / "run"
    log = run / "attempts" / "0" / "stdout.log"
    proc = _start(tmp_path, run, str(CHILDREN / "chatty.py"), "1000", "200", "0.01")
    try:
        _wait_text(log, b"step 50 ")
        ballast = _fill(run.parent)
        time.sleep(4)
        assert proc.poll() is None, (tmp_path / "err").read_text()
        ballast.unlink()
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_bytes()
    assert b"bytes of output could not be logged here (No space left on device)]" in text
    assert text.endswith(b"step 1000 " + b"x" * 189 + b"\ndone\n")
    events = read_events(run / "events.jsonl")
    assert [e["kind"] for e in events if e["kind"] != "heartbeat_summary"] == \
        ["launch", "exit", "decision", "finished"]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert load_state(run).status.value == "finished"


def test_the_end_of_a_run_is_recorded_once_there_is_room(tmp_path, small_tmpfs):
    run = small_tmpfs("8m") / "run"
    go = tmp_path / "go"
    proc = _start(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go))
    try:
        _wait_text(run / "attempts" / "0" / "stdout.log", b"ready")
        ballast = _fill(run.parent)
        go.touch()  # the child ends while nothing can be written under the run dir
        time.sleep(4)
        assert proc.poll() is None, (tmp_path / "err").read_text()
        assert load_state(run).status.value == "running"
        ballast.unlink()
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "decision", "finished"]
    assert load_state(run).status.value == "finished"
    assert "waiting up to 60 s for room" in (tmp_path / "err").read_text()


def test_a_relaunch_while_not_even_a_directory_can_be_made(tmp_path, small_tmpfs):
    # Few inodes: with them used up, the next attempt's directory and logs cannot be created.
    run = small_tmpfs("8m,nr_inodes=64") / "run"
    go = tmp_path / "go"
    proc = _start(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go), "1")
    ballast = run.parent / "inodes"
    try:
        _wait_text(run / "attempts" / "0" / "stdout.log", b"ready")
        ballast.mkdir()
        try:
            for i in range(1000):
                (ballast / str(i)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        go.touch()  # attempt 0 crashes now; attempt 1 runs with no room for its logs
        time.sleep(4)
        assert proc.poll() is None, (tmp_path / "err").read_text()
        assert not (run / "attempts" / "1").exists()
        for f in ballast.iterdir():
            f.unlink()
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "classification", "decision", "launch", "exit", "decision",
         "finished"]
    assert load_state(run).status.value == "finished"


def test_a_launch_onto_a_full_disk(tmp_path, small_tmpfs):
    # A requeued job that starts while the run dir's disk is full: it runs, and records how it
    # ended once there is room.
    disk = small_tmpfs("8m")
    run = disk / "run"
    go = tmp_path / "go"
    ballast = _fill(disk)
    go.touch()  # the child ends as soon as it starts
    proc = _start(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go))
    try:
        time.sleep(6)
        assert proc.poll() is None, (tmp_path / "err").read_text()
        ballast.unlink()
        assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "decision", "finished"]
    assert load_state(run).status.value == "finished"
