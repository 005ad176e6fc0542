"""What a SIGKILLed rtrain leaves running is ended by the next launch on the run dir, a
procs.json that an rtrain of this user did not sign for this run dir ends nothing, and a
checkpoint writer of an earlier attempt cannot commit into a run that moved on (real processes,
real signals, real files)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from harness import CHILDREN, child_env, gone, launch_cmd, wait_for

from rtrain.checkpoint import generation
from rtrain.supervisor.proc import leftovers, userkey
from rtrain.supervisor.records.events import read_events

LEAVE = CHILDREN / "leave_behind_on_kill.py"


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the file may exist before its content is written
        text = path.read_text() if path.exists() else ""
        if text.strip():
            return int(text)
        time.sleep(0.02)
    pytest.fail(f"{path} was never written")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_next_launch_ends_what_a_killed_rtrain_left(tmp_path):
    run, d = tmp_path / "run", tmp_path / "d"
    d.mkdir()
    first = subprocess.Popen(launch_cmd(run, str(LEAVE), str(d)), env=child_env(), cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left: list[int] = []
    try:
        grandchild = _read_pid(d / "grandchild.pid")
        writer = _read_pid(d / "writer.pid")
        left = [grandchild, writer]
        deadline = time.monotonic() + 30  # the watch records the tree at its next sample
        while time.monotonic() < deadline:
            procs = run / "procs.json"
            if procs.exists() and grandchild in [p for p, _ in
                                                 json.loads(procs.read_text())["procs"]]:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the grandchild never appeared in procs.json")
        child = read_events(run / "events.jsonl")[0]["pid"]
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert gone(child)  # PR_SET_PDEATHSIG
        time.sleep(0.5)
        assert _alive(grandchild) and _alive(writer)  # what the next launch must end
        r = subprocess.run(launch_cmd(run, str(LEAVE), str(d)), env=child_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert not _alive(grandchild) and not _alive(writer)
        ended = [e for e in read_events(run / "events.jsonl") if e["kind"] == "leftovers_ended"]
        assert len(ended) == 1
        found = dict(zip(ended[0]["pids"], ended[0]["found"], strict=True))
        assert found[grandchild] == "recorded"  # its environment was cleared
        assert writer in found
        ticks = (d / "ticks").stat().st_size
        time.sleep(0.3)
        assert (d / "ticks").stat().st_size == ticks  # nothing writes any more
        (d / "go").touch()
        time.sleep(0.3)
        assert not (d / "writer.result").exists()
        assert not (run / "checkpoints" / "checkpoint-7").exists()
    finally:
        if first.poll() is None:
            first.kill()
        for pid in left:
            if _alive(pid):
                psutil.Process(pid).kill()


WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from rtrain.checkpoint.commit import PendingCheckpoint
    from rtrain.checkpoint.generation import StaleWriter
    d = Path(sys.argv[1])
    pending = PendingCheckpoint(os.environ["RTRAIN_CKPT_DIR"], int(sys.argv[2]), fsync=False)
    pending.write_json("state.json", {"step": int(sys.argv[2])})
    (d / "ready").touch()
    while not (d / "go").exists():
        time.sleep(0.02)
    try:
        pending.commit({})
        print("committed")
    except StaleWriter as e:
        print(f"refused: {e}")
""")


def _writer(d: Path, ckpt: Path, step: int, token: str) -> subprocess.Popen:
    d.mkdir()
    return subprocess.Popen([sys.executable, "-c", WRITER, str(d), str(step)],
                            env=child_env(RTRAIN_CKPT_DIR=str(ckpt), RTRAIN_GENERATION=token),
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_writer_of_an_earlier_attempt_cannot_commit(tmp_path):
    ckpt = tmp_path / "ckpt"
    old = generation.new_token()
    generation.advance(ckpt, old)  # as launch does before an attempt
    stale = _writer(tmp_path / "stale", ckpt, 7, old)
    wait_for(tmp_path / "stale" / "ready")
    new = generation.new_token()
    generation.advance(ckpt, new)  # the next attempt started
    current = _writer(tmp_path / "current", ckpt, 8, new)
    wait_for(tmp_path / "current" / "ready")
    (tmp_path / "stale" / "go").touch()
    (tmp_path / "current" / "go").touch()
    out_stale, _ = stale.communicate(timeout=30)
    out_current, _ = current.communicate(timeout=30)
    assert out_stale.startswith("refused: checkpoint-7 not committed: its run has moved on")
    assert out_current.strip() == "committed"
    assert sorted(p.name for p in ckpt.iterdir()) == [".rtrain-generation", "checkpoint-8"]


# ------------------------------------------------------------------ a record someone else wrote


def _sleeper() -> subprocess.Popen:
    """An unrelated process of this user: no RTRAIN_* in its environment."""
    return subprocess.Popen(["sleep", "600"], env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _forge(run: Path, pid: int, *, mac: str | None = "0" * 64, v: int = 2) -> None:
    """procs.json naming `pid` with its real start time, host and boot (all public)."""
    body = {"v": v, "host": socket.gethostname(), "supervisor": [1, 1],
            "procs": [[pid, leftovers.start_time(pid)]]}
    if v == 2:
        body["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    if mac is not None:
        body["mac"] = mac
    run.mkdir(parents=True, exist_ok=True)
    (run / "procs.json").write_text(json.dumps(body))


def _copied_from_another_run(run: Path, pid: int) -> None:
    """A record rtrain signed for another run dir of the same user, copied into this one."""
    other = run.parent / "other-run"
    other.mkdir()
    leftovers.ProcRecord(other).update([pid])
    run.mkdir(parents=True, exist_ok=True)
    (run / "procs.json").write_bytes((other / "procs.json").read_bytes())


FORGERIES = {
    "bad-signature": lambda run, pid: _forge(run, pid),
    "unsigned": lambda run, pid: _forge(run, pid, mac=None),
    "old-format": lambda run, pid: _forge(run, pid, mac=None, v=1),
    "copied-from-another-run": _copied_from_another_run,
}


@pytest.mark.slow
@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_procs_json_ends_nothing_and_says_why(tmp_path, forgery):
    run = tmp_path / "run"
    userkey.load(create=True)  # as a launch makes it (ProcRecord) before it sweeps
    victim = _sleeper()
    try:
        FORGERIES[forgery](run, victim.pid)
        swept = leftovers.end_leftovers(run)
        assert swept.ended == []
        assert [s.pid for s in swept.skipped] == [victim.pid]
        reason = swept.skipped[0].reason
        assert ("does not match" if forgery in ("bad-signature", "copied-from-another-run")
                else "not signed") in reason, reason
        assert "environment does not name the run" in reason
        time.sleep(0.2)
        assert victim.poll() is None, "the forged record had an unrelated process killed"
    finally:
        victim.kill()
        victim.wait()


@pytest.mark.slow
def test_a_signed_record_ends_a_process_whose_environment_was_cleared(tmp_path):
    run = tmp_path / "run"
    mine = _sleeper()  # no mark in its environment: only the signed record can name it
    try:
        leftovers.ProcRecord(run).update([mine.pid])
        swept = leftovers.end_leftovers(run)
        assert [(p.pid, p.why) for p in swept.ended] == [(mine.pid, "recorded")]
        assert swept.skipped == []
        assert mine.wait(timeout=10) == -signal.SIGKILL
    finally:
        if mine.poll() is None:
            mine.kill()
            mine.wait()


@pytest.mark.slow
def test_launch_on_a_forged_procs_json_leaves_the_process_and_records_why(tmp_path):
    run = tmp_path / "run"
    victim = _sleeper()
    try:
        _forge(run, victim.pid, mac=None, v=1)  # the record as rtrain wrote it, unsigned
        script = tmp_path / "done.py"
        script.write_text("print('done')\n")
        r = subprocess.run(launch_cmd(run, str(script)), env=child_env(), cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert victim.poll() is None, "launch killed a process a forged procs.json named"
        assert f"left pid {victim.pid} (sleep 600) running, although procs.json names it: " \
               "procs.json is not signed" in r.stderr, r.stderr
        skipped = [e for e in read_events(run / "events.jsonl")
                   if e["kind"] == "leftovers_skipped"]
        assert len(skipped) == 1 and skipped[0]["pids"] == [victim.pid]
        assert skipped[0]["commands"] == ["sleep 600"]
        assert "environment does not name the run" in skipped[0]["reasons"][0]
        assert not [e for e in read_events(run / "events.jsonl")
                    if e["kind"] == "leftovers_ended"]
    finally:
        victim.kill()
        victim.wait()
