"""What anyone who can write the run dir may put inside rtrain's own files there: a lock holder
with a start time no clock can show, state.json fields of the wrong type, an event nested a
hundred thousand levels deep. Each gives the normal answer or one line that names the file and
the field, with rtrain's exit code, never a traceback; a launch refuses before any attempt (the
run is not left marked running). In-process: the CLI through typer's runner, the launch loop
with a scripted child (tests/scripted_loop.py)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
from harness import invoke_rtrain, write_events
from scripted_loop import Script, run, success

from rtrain.supervisor.config import load_config
from rtrain.supervisor.core.errors import AlreadySupervised, ExitCode
from rtrain.supervisor.decide.policy import History
from rtrain.supervisor.launch.loop import LaunchSpec, launch
from rtrain.supervisor.records.events import EventLog, EventLogError, read_events
from rtrain.supervisor.records.lock import LOCK_NAME, RunLock
from rtrain.supervisor.records.runstate import RunState, StateError, load_state, save_state

LAUNCH = {"attempt": 0, "argv": ["train.py"], "settings": {}, "level": 0, "resume_from": None,
          "pid": 1}


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# ------------------------------------------------------------------ the lock's holder

@pytest.mark.parametrize(("holder", "pid"), [
    ('{"pid": 4321, "started": 1e300}', "4321"), ('{"pid": 4321, "started": NaN}', "4321"),
    ('{"pid": 4321, "started": -1e300}', "4321"), ('{"pid": 4321, "started": Infinity}', "4321"),
    ('{"pid": 4321, "started": "yesterday", "host": "\\u001b[2Jother"}', "4321"),
    ('{"pid": 1e300, "started": 0}', "?"),
    ('{"pid": 4321, "started": ' + "[" * 2000 + "]" * 2000 + "}", "?")])  # unreadable: no pid
def test_a_held_lock_with_any_holder_content_is_exit_4_with_the_usual_message(tmp_path,
                                                                              holder, pid):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "train.py").write_text("print('training')\n")
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.write(fd, holder.encode())
        fcntl.flock(fd, fcntl.LOCK_EX)  # a live rtrain holds the run
        with pytest.raises(AlreadySupervised) as err:
            RunLock(run_dir).acquire()
        assert f"is already supervised by rtrain pid {pid}" in str(err.value)
        assert "\x1b" not in str(err.value)
        r = invoke_rtrain("launch", "--run-dir", str(run_dir), "-q", "train.py", cwd=tmp_path)
    finally:
        os.close(fd)
    assert r.returncode == ExitCode.ALREADY_SUPERVISED == 4
    assert f"already supervised by rtrain pid {pid}" in one_line(r.stderr)
    assert "stop it or use another --run-dir" in r.stderr


@pytest.mark.parametrize("pid", [10**30, -1, 0])
def test_status_with_an_impossible_holder_pid_says_its_rtrain_is_gone(tmp_path, pid):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", LAUNCH)])
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": pid}))
    r = invoke_rtrain("status", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert f"its rtrain (pid {pid}) is gone" in r.stdout


# ------------------------------------------------------------------ state.json

def good_state(run_dir: Path) -> dict:
    history = History(attempt=2, budgets_used={"crash": 1}, level=1, settings={"bs": 8},
                      undo=({"set": {"bs": 16}, "divide": {}, "description": "bs 16 -> 8"},),
                      streak={"path": "p", "id": "1-2", "step": 4, "kind": "crash",
                              "last_step": 5, "count": 1})
    save_state(run_dir, RunState(command=["train.py", "--attempt", "{attempt}"],
                                 history=history, reason="crash budget 1/3"))
    return json.loads((run_dir / "state.json").read_text())


WRONG = {  # field path -> a value of the wrong type, and what the line names
    "command": ("train.py", "command is a string 'train.py', not a list of strings"),
    "created": ("yesterday", "created is a string 'yesterday', not a finite number"),
    "history.attempt": ("3", "history.attempt is a string '3', not an integer"),
    "history.budgets_used": ({"crash": "one"}, "history.budgets_used is an object"),
    "history.level": (None, "history.level is null, not an integer"),
    "history.settings": ([1], "history.settings is a list [1], not an object or null"),
    "history.undo": ([{"set": 5, "description": "x"}], "history.undo[0].set is a number 5"),
    "history.streak": ({"count": "2"}, "history.streak.count is a string '2'"),
    "history.quarantined": ([{"path": 5, "id": "x", "reason": "r"}],
                            "history.quarantined[0].path is a number 5, not a string"),
    "history.failure_times": ([1.5, "x"], "history.failure_times is a list"),
    "history.rung_peaks": ({"1": {"host": "big"}}, "history.rung_peaks is an object"),
    "history": (7, "history is a number 7, not an object"),
}


def _put(obj: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        obj = obj[p]
    obj[last] = value


@pytest.mark.parametrize("field", list(WRONG))
def test_a_wrong_typed_state_field_is_one_line_exit_2_for_status_report_and_launch(tmp_path,
                                                                                   field):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", LAUNCH)])
    raw = good_state(run_dir)
    value, named = WRONG[field]
    _put(raw, field, value)
    (run_dir / "state.json").write_text(json.dumps(raw))
    before = (run_dir / "state.json").read_bytes()
    with pytest.raises(StateError, match="unexpected content"):
        load_state(run_dir)
    for args in (["status", str(run_dir)],
                 ["report", str(run_dir), "-o", str(tmp_path / "r.html")]):
        r = invoke_rtrain(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        line = one_line(r.stderr)
        assert line.startswith(f"rtrain: error: {run_dir / 'state.json'}: unexpected content")
        assert named in line and "move it aside" in line
    script = Script([success()])
    with pytest.raises(StateError) as err:
        run(tmp_path, script)
    assert named in str(err.value) and err.value.exit_code == 2
    # Refused before any attempt: nothing ran, the run is not marked running.
    assert script.spawned == [] and (run_dir / "state.json").read_bytes() == before


def test_state_json_nested_deep_or_with_a_nan_time_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for text, says in (("[" * 100_000 + "]" * 100_000, "is nested more than 64 levels deep"),
                       ('{"v": 1, "created": NaN}', "created is a number nan, not a finite")):
        (run_dir / "state.json").write_text(text)
        r = invoke_rtrain("status", str(run_dir))
        assert r.returncode == 2 and says in one_line(r.stderr), r.stderr


# ------------------------------------------------------------------ events.jsonl

def deep_event(depth: int) -> bytes:
    return b'{"v": 1, "seq": 2, "kind": "launch", "x": ' + b"[" * depth + b"]" * depth + b"}\n"


@pytest.mark.parametrize("depth", [100_000, 500])
def test_a_deeply_nested_event_is_one_line_exit_2_for_status_and_report(tmp_path, depth):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", LAUNCH)])
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(deep_event(depth))
        f.write(b'{"v": 1, "seq": 3, "time": 1.0, "kind": "finished", "reason": "done"}\n')
    with pytest.raises(EventLogError, match=r"events.jsonl:2: an event nested more than 64"):
        read_events(run_dir / "events.jsonl")
    for args in (["status", str(run_dir)],
                 ["report", str(run_dir), "-o", str(tmp_path / "r.html")]):
        r = invoke_rtrain(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        line = one_line(r.stderr)
        assert "events.jsonl:2: an event nested more than 64 levels deep" in line
        assert "move the file aside" in line


def test_launch_over_a_deeply_nested_event_warns_and_runs_the_attempt(tmp_path):
    # Events are best effort (docs/architecture.md, threat model): a log rtrain cannot read is said,
    # not a reason to stop training; the launch appends to it.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_bytes(deep_event(100_000))  # the last line too
    script = Script([success()])
    config = load_config({"run_dir": run_dir, "metrics_file": tmp_path / "metrics.prom"},
                         None, tmp_path)
    code = launch(LaunchSpec(command=["train.py"], config=config, echo=False, cwd=tmp_path),
                  script.seams())
    assert code == 0 and len(script.spawned) == 1
    assert any("events.jsonl:1: an event nested more than 64 levels deep" in s
               for s in script.said), script.said
    assert load_state(run_dir).status.value == "finished"
    tail = (run_dir / "events.jsonl").read_bytes().split(b"\n")[1:]
    assert b'"kind":"finished"' in b"\n".join(tail)


def test_the_event_writer_continues_the_seq_past_a_deep_last_line(tmp_path):
    run_dir = tmp_path / "run"
    write_events(run_dir, [("launch", LAUNCH)])
    with open(run_dir / "events.jsonl", "ab") as f:
        f.write(deep_event(30_000))
    with EventLog(run_dir / "events.jsonl") as log:
        assert log.emit("finished", reason="done")["seq"] == 2  # the seq of the last it read
