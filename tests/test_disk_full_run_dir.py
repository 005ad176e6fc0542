"""A full disk under the run dir must not stop training or supervision (a real small tmpfs).

The attempt's log and events.jsonl are best effort while the disk is full: what cannot be
written is counted (the log says how much is missing) or held (events, state.json) until there
is room; the run's end is recorded once the ballast is gone.
"""

from __future__ import annotations

import contextlib
import errno
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tuned
from harness import CHILDREN, child_env, fill_disk, launch_cmd, wait_for_text

from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.records.runstate import load_state

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _supervising(tmp_path: Path, run: Path, *child: str) -> Iterator[subprocess.Popen]:
    """`rtrain launch` of the child in the background (stderr in tmp_path/err), killed if the
    test leaves it running."""
    # Events every half second: some are due while the disk is full.
    tuned.write(tmp_path, {"summary_every_s": 0.5})
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen(launch_cmd(run, *child), env=child_env(), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _still_supervising(proc: subprocess.Popen, tmp_path: Path, seconds: float) -> None:
    time.sleep(seconds)
    assert proc.poll() is None, (tmp_path / "err").read_text()


def _finishes(proc: subprocess.Popen, tmp_path: Path) -> None:
    assert proc.wait(timeout=120) == 0, (tmp_path / "err").read_text()


def test_training_goes_on_through_a_full_disk(tmp_path, small_tmpfs):
    run = small_tmpfs("8m") / "run"
    log = run / "attempts" / "0" / "stdout.log"
    with _supervising(tmp_path, run, str(CHILDREN / "chatty.py"), "1000", "200", "0.01") as proc:
        wait_for_text(log, "step 50 ", timeout=60)
        ballast = fill_disk(run.parent)
        _still_supervising(proc, tmp_path, 4)
        ballast.unlink()
        _finishes(proc, tmp_path)
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
    with _supervising(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go)) as proc:
        wait_for_text(run / "attempts" / "0" / "stdout.log", "ready", timeout=60)
        ballast = fill_disk(run.parent)
        go.touch()  # the child ends while nothing can be written under the run dir
        _still_supervising(proc, tmp_path, 4)
        assert load_state(run).status.value == "running"
        ballast.unlink()
        _finishes(proc, tmp_path)
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "decision", "finished"]
    assert load_state(run).status.value == "finished"
    assert "waiting up to 60 s for room" in (tmp_path / "err").read_text()


def test_a_relaunch_while_not_even_a_directory_can_be_made(tmp_path, small_tmpfs):
    # Few inodes: with them used up, the next attempt's directory and logs cannot be created.
    run = small_tmpfs("8m,nr_inodes=64") / "run"
    go = tmp_path / "go"
    ballast = run.parent / "inodes"
    with _supervising(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go), "1") as proc:
        wait_for_text(run / "attempts" / "0" / "stdout.log", "ready", timeout=60)
        ballast.mkdir()
        try:
            for i in range(1000):
                (ballast / str(i)).touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC
        go.touch()  # attempt 0 crashes now; attempt 1 runs with no room for its logs
        _still_supervising(proc, tmp_path, 4)
        assert not (run / "attempts" / "1").exists()
        for f in ballast.iterdir():
            f.unlink()
        _finishes(proc, tmp_path)
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "classification", "decision", "cannot_resume", "launch", "exit",
         "decision", "finished"]
    assert load_state(run).status.value == "finished"


def test_a_launch_onto_a_full_disk(tmp_path, small_tmpfs):
    # A requeued job that starts while the run dir's disk is full: it runs, and records how it
    # ended once there is room.
    disk = small_tmpfs("8m")
    run = disk / "run"
    go = tmp_path / "go"
    ballast = fill_disk(disk)
    go.touch()  # the child ends as soon as it starts
    with _supervising(tmp_path, run, str(CHILDREN / "wait_for_file.py"), str(go)) as proc:
        _still_supervising(proc, tmp_path, 6)
        ballast.unlink()
        _finishes(proc, tmp_path)
    assert [e["kind"] for e in read_events(run / "events.jsonl")] == \
        ["launch", "exit", "decision", "finished"]
    assert load_state(run).status.value == "finished"
