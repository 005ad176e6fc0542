"""events.jsonl: append, continue seq across writers, tolerate a torn last line."""

from __future__ import annotations

import json

import pytest

from rtrain.supervisor.records.events import EVENTS_VERSION, EventLog, EventLogError, read_events


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1
        return self.t


def test_emit_and_read_back(tmp_path):
    path = tmp_path / "run" / "events.jsonl"
    with EventLog(path, clock=FakeClock()) as log:
        log.emit("launch", attempt=0, argv=["python", "train.py"], ckpt_dir=tmp_path)
        log.emit("heartbeat_summary", step=10)
    events = read_events(path)
    assert [e["kind"] for e in events] == ["launch", "heartbeat_summary"]
    assert [e["seq"] for e in events] == [1, 2]
    assert [e["time"] for e in events] == [1001.0, 1002.0]
    assert events[0]["v"] == EVENTS_VERSION and events[0]["ckpt_dir"] == str(tmp_path)


def test_torn_last_line_is_skipped_and_cut_before_appending(tmp_path):
    path = tmp_path / "events.jsonl"
    with EventLog(path, clock=FakeClock()) as log:
        log.emit("launch")
        log.emit("exit", returncode=1)
    with path.open("ab") as f:
        f.write(b'{"v":1,"time":5,"seq":3,"kind":"deci')  # killed mid-write
    assert [e["seq"] for e in read_events(path)] == [1, 2]
    with EventLog(path, clock=FakeClock()) as log:
        log.emit("decision", action="relaunch")
    events = read_events(path)
    assert [(e["seq"], e["kind"]) for e in events] == [(1, "launch"), (2, "exit"),
                                                       (3, "decision")]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_last_event_without_newline_still_counts(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"v":1,"time":1,"seq":1,"kind":"launch"}')
    assert [e["kind"] for e in read_events(path)] == ["launch"]


def test_bad_middle_line_and_unknown_version_are_refused(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"v":1,"seq":1,"kind":"launch"}\nnot json\n{"v":1,"seq":2,"kind":"exit"}\n')
    with pytest.raises(EventLogError, match=r"events.jsonl:2: not a JSON event"):
        read_events(path)
    path.write_text('{"v":99,"seq":1,"kind":"launch"}\n')
    with pytest.raises(EventLogError, match="version 99"):
        read_events(path)


def test_missing_log_reads_empty(tmp_path):
    assert read_events(tmp_path / "none.jsonl") == []
