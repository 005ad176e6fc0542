"""A run that gave up stays down for wrappers: the same `rtrain launch` exits 5 at once without
launching; `--retry` relaunches it with fresh budgets; `--fresh` starts it over. The launch loop
with a scripted child (scripted_loop.py); the exit 5 of a real `rtrain launch` after a real
crash loop is tests/test_policy_kills.py's."""

from __future__ import annotations

from pathlib import Path

from scripted_loop import PID0, Script, crash, run, success

from rtrain.supervisor.core.errors import ExitCode
from rtrain.supervisor.records.runstate import load_state

CRASH_LOOP_2 = {"restart.crash_loop_k": 2}


def gave_up_run(tmp_path: Path) -> None:
    """A run whose first two attempts crash before any checkpoint: the crash loop (k=2)."""
    script = Script([crash(), crash()])
    code, events = run(tmp_path, script, **CRASH_LOOP_2)
    assert code == 1 and len(script.spawned) == 2
    [give_up] = [e for e in events if e["kind"] == "give_up"]
    assert "crash loop" in give_up["reason"]


def test_the_same_command_again_launches_nothing_and_exits_5(tmp_path):
    gave_up_run(tmp_path)
    for _ in range(2):  # a cron entry repeating the command
        again = Script([success()])
        code, events = run(tmp_path, again, **CRASH_LOOP_2)
        assert code == ExitCode.GAVE_UP_EARLIER == 5 and again.spawned == []
        assert len([e for e in events if e["kind"] == "launch"]) == 2
        assert all(w in again.said[-1] for w in ("gave up", "crash loop", "--retry", "--fresh"))
    assert load_state(tmp_path / "run").status.value == "gave_up"


def test_retry_relaunches_with_fresh_budgets(tmp_path):
    gave_up_run(tmp_path)
    assert load_state(tmp_path / "run").history.budgets_used == {"crash": 1}
    code, events = run(tmp_path, Script([success()]), retry=True, **CRASH_LOOP_2)
    assert code == 0
    assert [e["attempt"] for e in events if e["kind"] == "launch"] == [0, 1, 2]
    assert load_state(tmp_path / "run").status.value == "finished"


def test_fresh_starts_over(tmp_path):
    gave_up_run(tmp_path)
    script = Script([crash(), crash()])
    code, events = run(tmp_path, script, fresh=True, **CRASH_LOOP_2)
    assert code == 1  # attempts 0 and 1 again: it gave up again, by its own rules
    assert [e["attempt"] for e in events if e["kind"] == "launch"] == [0, 1, 0, 1]
    assert [c.pid for c in script.spawned] == [PID0, PID0 + 1]
