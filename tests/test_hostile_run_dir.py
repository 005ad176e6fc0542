"""What anyone who can write the run or checkpoint dir may plant at a name rtrain writes or reads
there: a symbolic link to a file of the user ("victim"), a FIFO, a second name (hard link) of
another file. rtrain never writes through it (the victim is unchanged), never blocks on it,
and says which file and what to do (exit 2). Files rtrain creates there are the run's mode
(owner-only by default) whatever the directory's own mode. In-process: launches run with a
scripted child (tests/scripted_loop.py) or stop before any would start."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import child_spec, invoke_rtrain, write_events
from scripted_loop import Script, run, success

from rtrain.checkpoint import generation, quarantine
from rtrain.checkpoint.generation import GENERATION_FILE
from rtrain.checkpoint.quarantine import QUARANTINE_FILE
from rtrain.supervisor.ckpt import keepcopy
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.proc.leftovers import PROCS_FILE
from rtrain.supervisor.proc.logcap import CappedLog
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.stacks import dump_stacks
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.records.lock import LOCK_NAME, RunLock
from rtrain.supervisor.records.runstate import STATE_FILE, load_state
from rtrain.worker import runtime

VICTIM_TEXT = "the user's own file: rtrain must never change it\n"


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim"
    path.write_text(VICTIM_TEXT)
    path.chmod(0o644)
    return path


def unchanged(victim: Path) -> bool:
    return (victim.read_text() == VICTIM_TEXT
            and stat.S_IMODE(victim.stat().st_mode) == 0o644)


def plant_link(at: Path, victim: Path) -> None:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(victim)


@contextlib.contextmanager
def fifo(at: Path) -> Iterator[Path]:
    """A FIFO at `at`; afterwards anything still blocked opening it is released (a reader and
    writer in one), so a test of code that hangs on it fails instead of hanging the suite."""
    at.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(at)
    try:
        yield at
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(at, os.O_RDWR | os.O_NONBLOCK))


def bounded(fn: Callable[[], Any], timeout: float = 10.0) -> Any:
    """`fn()` in a thread; fails the test when it is still running after `timeout` s (blocked
    on a FIFO, say), else returns what it returned or raises what it raised."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test's thread
            out["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"still blocked after {timeout:g} s", pytrace=False)
    if "error" in out:
        raise out["error"]
    return out["value"]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# ------------------------------------------------------------------ the opener itself

def test_open_own_refuses_a_link_a_fifo_and_a_second_name(tmp_path, victim):
    plant_link(tmp_path / "link", victim)
    with pytest.raises(ownfiles.RefusedFile, match=r"is a symbolic link .* never follows"):
        ownfiles.open_own(tmp_path / "link", os.O_RDWR, create=True)
    os.link(victim, tmp_path / "second")
    with pytest.raises(ownfiles.RefusedFile, match="has 2 names"):
        ownfiles.open_own(tmp_path / "second", os.O_WRONLY | os.O_APPEND)
    with fifo(tmp_path / "pipe") as pipe:
        for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
            with pytest.raises(ownfiles.RefusedFile, match=r"is a FIFO \(named pipe\)"):
                bounded(lambda f=flags: ownfiles.open_own(pipe, f, create=True))
        with pytest.raises(ownfiles.RefusedFile, match="FIFO"):
            bounded(lambda: ownfiles.read_own(pipe))
    (tmp_path / "dir").mkdir()
    with pytest.raises(ownfiles.RefusedFile, match="is a directory"):
        ownfiles.read_own(tmp_path / "dir")
    assert unchanged(victim)
    err = ownfiles.RefusedFile(tmp_path / "link", "is a symbolic link")
    assert isinstance(err, OSError) and err.exit_code == 2
    assert str(err).endswith("remove it (or move it aside) and run again")


def test_open_own_creates_owner_only_in_an_open_dir_and_keeps_blocking_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    old = os.umask(0)
    try:
        opened = ownfiles.open_own(shared / "f", os.O_RDWR, create=True)
    finally:
        os.umask(old)
    try:
        assert opened.created and stat.S_IMODE(os.fstat(opened.fd).st_mode) == 0o600
        assert os.get_blocking(opened.fd)
    finally:
        os.close(opened.fd)
    again = ownfiles.open_own(shared / "f", os.O_RDWR, create=True)
    os.close(again.fd)
    assert not again.created
    with pytest.raises(ValueError, match="never truncates"):
        ownfiles.open_own(shared / "f", os.O_WRONLY | os.O_TRUNC)
    with pytest.raises(FileNotFoundError):  # no directory to create it in: said as such
        ownfiles.open_own(shared / "gone" / "f", os.O_WRONLY, create=True)


# ------------------------------------------------------------------ each name, a link planted

def test_generation_token_through_a_link_is_refused(tmp_path, victim):
    ckpt = tmp_path / "ckpt"
    plant_link(ckpt / GENERATION_FILE, victim)
    with pytest.raises(ownfiles.RefusedFile, match=r"\.rtrain-generation is a symbolic link"):
        generation.advance(ckpt, generation.new_token())
    with pytest.raises(ownfiles.RefusedFile), generation.committing(ckpt, "a" * 32, "ckpt"):
        pass
    assert unchanged(victim)


def test_generation_file_rtrain_did_not_write_is_not_truncated(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    notes = ckpt / GENERATION_FILE
    notes.write_text("someone's notes, not a token\n")
    with pytest.raises(ownfiles.RefusedFile, match="something other than a generation token"):
        generation.advance(ckpt, generation.new_token())
    assert notes.read_text() == "someone's notes, not a token\n"
    generation.advance(tmp_path / "fresh", "ab" * 16)  # rtrain's own: rewritten in place
    generation.advance(tmp_path / "fresh", "cd" * 16)
    assert generation.current(tmp_path / "fresh") == "cd" * 16


def test_lock_events_and_logs_through_a_link_are_refused(tmp_path, victim, caplog):
    run_dir = tmp_path / "run"
    plant_link(run_dir / LOCK_NAME, victim)
    with pytest.raises(ownfiles.RefusedFile, match=r"\.rtrain\.lock is a symbolic link"):
        RunLock(run_dir).acquire()
    plant_link(run_dir / "events.jsonl", victim)
    with pytest.raises(ownfiles.RefusedFile, match=r"events\.jsonl is a symbolic link"):
        EventLog(run_dir / "events.jsonl")
    log_path = run_dir / "attempts" / "0" / "stdout.log"
    plant_link(log_path, victim)
    with caplog.at_level(logging.WARNING):
        capped = CappedLog(log_path, 1 << 20)
        capped.write(b"the child's output\n" * 100)
        capped.close()  # the output is lost, the run is not
    assert "stdout.log is a symbolic link" in caplog.text
    assert unchanged(victim)


def test_a_hard_link_to_a_users_file_is_not_appended_to(tmp_path, victim):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.link(victim, run_dir / "events.jsonl")
    with pytest.raises(ownfiles.RefusedFile, match="has 2 names"):
        EventLog(run_dir / "events.jsonl")
    os.link(victim, run_dir / LOCK_NAME)
    with pytest.raises(ownfiles.RefusedFile, match="has 3 names"):
        RunLock(run_dir).acquire()
    assert unchanged(victim)


def test_stack_dump_file_through_a_link_is_refused(tmp_path, victim, caplog):
    attempt = tmp_path / "run" / "attempts" / "0"
    plant_link(attempt / f"stacks-{os.getpid()}.txt", victim)
    with caplog.at_level(logging.WARNING):
        assert runtime.open_stack_file(attempt) is None  # no dump; training goes on
    assert "is a symbolic link" in caplog.text
    assert unchanged(victim)


def test_quarantine_note_and_kept_copy_replace_a_link_never_write_through_it(tmp_path, victim):
    ckpt = tmp_path / "ckpt"
    plant_link(ckpt / QUARANTINE_FILE, victim)
    quarantine.publish(ckpt, [{"path": str(ckpt / "checkpoint-5"), "id": "1-2", "step": 5,
                               "reason": "failed 3 times"}])
    assert not (ckpt / QUARANTINE_FILE).is_symlink() and "checkpoint-5" in quarantine.load(ckpt)
    # The kept copy of a foreign file is written at a fixed temp name first.
    kept = tmp_path / "run" / keepcopy.KEPT_DIR
    plant_link(kept / ".ckpt.pt.tmp", victim)
    source = tmp_path / "ckpt.pt"
    source.write_bytes(b"weights")
    keepcopy._clone(source, kept / ".ckpt.pt.tmp", 0o600)
    assert (kept / ".ckpt.pt.tmp").read_bytes() == b"weights"
    assert not (kept / ".ckpt.pt.tmp").is_symlink()
    assert unchanged(victim)


@pytest.mark.parametrize(("where", "name"), [
    ("ckpt", GENERATION_FILE), ("run", LOCK_NAME), ("run", "events.jsonl"), ("run", STATE_FILE),
    ("run", PROCS_FILE), ("ckpt", QUARANTINE_FILE), ("run", "standby.log"),
    ("run", "mirror.log"), ("ckpt", ".rtrain-mirror.lock")])
def test_launch_refuses_a_link_at_any_name_it_keeps_before_anything_runs(tmp_path, victim,
                                                                          where, name):
    run_dir = tmp_path / "run"
    planted = (run_dir if where == "run" else run_dir / "checkpoints") / name
    plant_link(planted, victim)
    script = Script([success()])
    with pytest.raises(ownfiles.RefusedFile) as err:
        run(tmp_path, script)
    assert f"{name} is a symbolic link" in str(err.value) and err.value.exit_code == 2
    assert "remove it" in str(err.value)
    assert script.spawned == []
    if name != STATE_FILE:
        assert load_state(run_dir) is None  # nothing recorded, not even "running"
    assert unchanged(victim)


def test_cli_launch_names_the_planted_link_exit_2(tmp_path, victim):
    run_dir = tmp_path / "run"
    plant_link(run_dir / "checkpoints" / GENERATION_FILE, victim)
    (tmp_path / "train.py").write_text("print('training')\n")
    r = invoke_rtrain("launch", "--run-dir", str(run_dir), "-q", "train.py", cwd=tmp_path)
    assert r.returncode == 2
    line = one_line(r.stderr)
    assert line.startswith("rtrain: error: ") and ".rtrain-generation is a symbolic link" in line
    assert unchanged(victim)


# ------------------------------------------------------------------ FIFOs: never block

@pytest.mark.parametrize("name", ["events.jsonl", STATE_FILE])
def test_status_and_report_refuse_a_fifo_at_once(tmp_path, name):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", {"attempt": 0, "argv": ["train.py"], "settings": {},
                                       "level": 0, "resume_from": None, "pid": 1})])
    if name == "events.jsonl":
        (run_dir / name).unlink()
    with fifo(run_dir / name):
        for args in (["status", str(run_dir)], ["report", str(run_dir), "-o",
                                                str(tmp_path / "r.html")]):
            r = bounded(lambda a=args: invoke_rtrain(*a))
            assert r.returncode == 2, r.stderr
            assert f"{name} is a FIFO (named pipe), not a regular file" in one_line(r.stderr)


@pytest.mark.parametrize("name", ["events.jsonl", STATE_FILE, PROCS_FILE])
def test_launch_refuses_a_fifo_at_once(tmp_path, name):
    script = Script([success()])
    with fifo(tmp_path / "run" / name), pytest.raises(ownfiles.RefusedFile,
                                                      match=rf"{name} is a FIFO"):
        bounded(lambda: run(tmp_path, script))
    assert script.spawned == []


def test_status_beside_a_fifo_lock_still_answers(tmp_path):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", {"attempt": 0, "argv": ["train.py"], "settings": {},
                                       "level": 0, "resume_from": None, "pid": 1})])
    with fifo(run_dir / LOCK_NAME):
        r = bounded(lambda: invoke_rtrain("status", str(run_dir)))
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------ modes: owner-only

def test_attempt_logs_and_stack_dumps_are_owner_only_in_a_0755_run_dir(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o755)  # `--run-dir .` in a home directory
    attempt = run_dir / "attempts" / "0"
    monkeypatch.delenv("RTRAIN_FILE_MODE", raising=False)
    old = os.umask(0o022)
    try:
        log = CappedLog(attempt / "stdout.log", 1 << 20)
        log.write(b"step 1\n")
        log.close()
        assert stat.S_IMODE((attempt / "stdout.log").stat().st_mode) == 0o600
        dump = runtime.open_stack_file(attempt)
        assert dump is not None
        dump.close()
        assert stat.S_IMODE((attempt / f"stacks-{os.getpid()}.txt").stat().st_mode) == 0o600
    finally:
        os.umask(old)
    # A team's mode is the run's file_mode, handed to the worker in RTRAIN_FILE_MODE.
    monkeypatch.setenv("RTRAIN_FILE_MODE", "0640")
    (attempt / f"stacks-{os.getpid()}.txt").unlink()
    dump = runtime.open_stack_file(attempt)
    dump.close()
    assert stat.S_IMODE((attempt / f"stacks-{os.getpid()}.txt").stat().st_mode) == 0o640


@pytest.mark.slow
def test_a_real_attempts_logs_are_owner_only_and_follow_file_mode(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o755)
    for mode in ("0600", "0640"):
        spec = child_spec(run_dir, "crash_with_code.py", "0",
                          env={"RTRAIN_FILE_MODE": mode})
        spec = dataclasses.replace(spec, attempt_dir=run_dir / "attempts" / mode)
        child = spawn(spec)
        while child.stdout.pump() or child.stderr.pump():
            time.sleep(0.01)
        child.popen.wait(timeout=60)
        child.close()
        for name in ("stdout.log", "stderr.log"):
            got = stat.S_IMODE((spec.attempt_dir / name).stat().st_mode)
            assert got == int(mode, 8), (name, oct(got))


FAKE_PYSPY = """#!/bin/sh
echo "stacks of $3"
"""


@pytest.mark.slow
def test_py_spy_stacks_are_owner_only_and_never_written_through_a_link(tmp_path, victim,
                                                                       monkeypatch, caplog):
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYSPY)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    attempt = tmp_path / "run" / "attempts" / "0"
    attempt.mkdir(parents=True)
    attempt.parent.parent.chmod(0o755)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        planted = attempt / f"stacks-pyspy-{child.pid}.txt"
        plant_link(planted, victim)
        with caplog.at_level(logging.WARNING):
            assert dump_stacks([child.pid], attempt, signal.SIGUSR2, timeout_s=5.0) == []
        assert "is a symbolic link" in caplog.text and unchanged(victim)
        planted.unlink()
        old = os.umask(0o022)
        try:
            files = dump_stacks([child.pid], attempt, signal.SIGUSR2, timeout_s=5.0)
        finally:
            os.umask(old)
        assert files == [planted] and f"stacks of {child.pid}" in planted.read_text()
        assert stat.S_IMODE(planted.stat().st_mode) == 0o600
    finally:
        child.kill()
        child.wait()
