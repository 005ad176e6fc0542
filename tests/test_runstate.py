"""state.json: atomic, versioned round trip."""

from __future__ import annotations

import json

import pytest

from rtrain.supervisor.decide.policy import History
from rtrain.supervisor.records.runstate import (
    RunState,
    RunStatus,
    StateError,
    load_state,
    save_state,
    state_path,
)


def test_round_trip(tmp_path):
    h = History(attempt=2, budgets_used={"oom": 1}, level=1, settings={"batch_size": 32},
                undo=({"set": {"batch_size": 64}, "description": "batch_size 64 -> 32"},),
                stalled=(10,), launch_step=10)
    state = RunState(command=["python", "train 'x'.py", "--a\nb"], cwd=str(tmp_path),
                     status=RunStatus.PREEMPTED, reason="stopped", created=1.0, updated=2.0,
                     history=h)
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".state-")]  # no temp left


def test_missing_state_is_none(tmp_path):
    assert load_state(tmp_path) is None


@pytest.mark.parametrize(("content", "message"), [
    ({"v": 2, "status": "running", "command": []}, "state version 2 is not 1"),
    ({"status": "running", "command": []}, "state version None is not 1"),
    ({"v": 1, "status": "exploded", "command": []}, "unexpected content"),
    ({"v": 1, "status": "running", "command": [], "history": {"nope": 1}}, "unexpected content"),
])
def test_bad_state_is_refused_with_a_clear_message(tmp_path, content, message):
    state_path(tmp_path).write_text(json.dumps(content))
    with pytest.raises(StateError, match=message):
        load_state(tmp_path)


def test_torn_json_is_refused(tmp_path):
    state_path(tmp_path).write_text('{"v": 1, "sta')
    with pytest.raises(StateError, match="not valid JSON"):
        load_state(tmp_path)
