"""What each failure cost (records/recovery.py): the phases from a table of moments, the tracker
fed events and heartbeats in order, the fold per kind, and what status, report and the metrics
file show of it. The real supervised run is tests/test_recovery_run.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from harness import write_events

from rtrain.supervisor.commands.report import gather
from rtrain.supervisor.commands.report_html import render
from rtrain.supervisor.commands.status import render_text, summarize, to_json
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.metrics.file import MetricsFile
from rtrain.supervisor.records.recovery import (
    PHASES,
    Marks,
    RecoveryTracker,
    breakdown,
    costs_by_kind,
    describe,
    seconds,
)

# A crash that wrote its exit record at 100.0 and was gone at 100.2; classified 10 ms later; a
# 1 s backoff; the spawn began at 101.25 and exec'd 5 ms later (the worker's process start,
# known to the 10 ms tick, reads 101.24); the Checkpointer's first heartbeat at 102.4, a 0.5 s
# restore that ended at 103.0, the first step at 103.3. Step 12 was reached, step 10 restored.
BASE = Marks(failure="crash", failed_attempt=0, last_step=12, reported_at=100.0,
             exited_at=100.2, classified_at=100.21, backoff_s=1.0, attempt=1, spawn_at=101.25,
             spawn_s=0.005, launched_at=101.26, resume_step=10, started_at=101.24,
             first_report_at=102.4, restored_at=103.0, restore_s=0.5, restored_step=10,
             first_step_at=103.3, step_time_s=0.1)
FULL = {"teardown": 0.2, "detection": 0.01, "decision": 0.04, "backoff": 1.0, "spawn": 0.005,
        "imports": 1.245, "restore": 0.5, "first_step": 0.3}


@pytest.mark.parametrize("marks, phases, total, steps, lost", [
    (BASE, FULL, 3.3, 2, 3.5),
    # SIGKILL: no exit record, so no teardown; the cost counts from the exit.
    (replace(BASE, reported_at=None), {**FULL, "teardown": None}, 3.1, 2, 3.3),
    # A hang: from the watch's verdict; stacks and the stop's grace are the teardown.
    (replace(BASE, reported_at=None, hang_at=95.2), {**FULL, "teardown": 5.0}, 8.1, 2, 8.3),
    # A stop signal cut the backoff short: what was waited is backoff, nothing is decision.
    (replace(BASE, backoff_s=5.0), {**FULL, "decision": 0.0, "backoff": 1.04}, 3.3, 2, 3.5),
    # An interpreter started ahead marks its hand-over after the exec: spawn runs to it.
    (replace(BASE, started_at=101.4), {**FULL, "spawn": 0.15, "imports": 1.1}, 3.3, 2, 3.5),
    # A worker that does not say when it started: the exec counts.
    (replace(BASE, started_at=None), FULL, 3.3, 2, 3.5),
    # Neither the worker's start nor spawn_s (an older log): the launch event.
    (replace(BASE, started_at=None, spawn_s=None),
     {**FULL, "spawn": 0.01, "imports": 1.24}, 3.3, 2, 3.5),
    # No restore heartbeat (a script without Checkpointer.restore): imports end at the first
    # heartbeat, the first step counts from there.
    (replace(BASE, restored_at=None, restore_s=None, restored_step=None),
     {**FULL, "imports": 1.145, "restore": None, "first_step": 0.9}, 3.3, 2, 3.5),
    # Saved at the failure: the relaunch resumes at the last step, nothing is run again.
    (replace(BASE, restored_step=12), FULL, 3.3, 0, 3.3),
    # No restore heartbeat: the step of the launch's checkpoint (0: a fresh start).
    (replace(BASE, restored_step=None, resume_step=0), FULL, 3.3, 12, 4.5),
    # No step time known: the steps are counted, their seconds are not.
    (replace(BASE, step_time_s=None), FULL, 3.3, 2, 3.3),
    # The relaunched attempt died at 104 before a step: the cost up to that ending.
    (replace(BASE, first_step_at=None, ended_at=104.0), {**FULL, "first_step": None}, 4.0, 2,
     4.2),
    # Clocks of two processes: a first heartbeat before the exec reads as no time, never less.
    (replace(BASE, restored_at=None, restore_s=None, first_report_at=101.0),
     {**FULL, "imports": 0.0, "restore": None, "first_step": 2.045}, 3.3, 2, 3.5),
])
def test_breakdown(marks, phases, total, steps, lost):
    r = breakdown(marks)
    assert {p: r[f"{p}_s"] for p in PHASES} == pytest.approx(phases, abs=1e-3)
    assert r["total_s"] == pytest.approx(total, abs=1e-3)
    assert r["steps_lost"] == steps and r["lost_s"] == pytest.approx(lost, abs=1e-3)
    assert r["complete"] is (marks.first_step_at is not None)
    # The phases measured add up to the total; an unfinished recovery's end (the relaunched
    # attempt's own failure) comes after the last phase it reached.
    measured = sum(v for p in PHASES if (v := r[f"{p}_s"]) is not None)
    if r["complete"]:
        assert measured == pytest.approx(total, abs=1e-3)
    else:
        assert measured < total


def _events(*items):
    """Events as the log hands them to listeners: kind, time and fields."""
    return [{"kind": kind, "time": t, **fields} for kind, t, fields in items]


FAIL = _events(
    ("launch", 1.0, {"attempt": 0, "resume_from": None, "spawn_at": 0.99, "spawn_s": 0.005}),
    ("exit", 100.25, {"attempt": 0, "last_step": 12, "reported_at": 100.0,
                      "exited_at": 100.2}),
    ("classification", 100.21, {"attempt": 0, "failure": "crash"}),
    ("decision", 100.22, {"attempt": 0, "action": "relaunch", "backoff_s": 1.0}),
    ("launch", 101.26, {"attempt": 1, "resume_from": "/c/checkpoint-10", "spawn_at": 101.25,
                        "spawn_s": 0.005}))


def _hb(t, event="step", step=None, **kw):
    return Heartbeat(pid=1, rank=kw.pop("rank", 0), time=t, event=event, step=step, **kw)


# Attempt 0's steps: 2 .. 12 over 1 s, one heartbeat per step.
STEPS_0 = [_hb(99.0 + 0.1 * (s - 2), step=s) for s in range(2, 13)]
RELAUNCH = [_hb(102.4, "start", started=101.24), _hb(103.0, "start", step=10, restore_s=0.5),
            _hb(103.2, step=11, rank=1), _hb(103.3, step=11)]


def _track(events, heartbeats_by_attempt):
    t = RecoveryTracker()
    out = []
    for e in events:
        t(e)
        for hb in heartbeats_by_attempt.get((e["kind"], e.get("attempt")), []):
            t.heartbeat(e["attempt"], hb)
        out += t.take()
    return out


def test_tracker_records_one_recovery_at_the_first_step_of_the_relaunch():
    got = _track(FAIL, {("launch", 0): STEPS_0, ("launch", 1): RELAUNCH})
    assert len(got) == 1
    r = got[0]
    assert (r["failure"], r["failed_attempt"], r["attempt"], r["complete"]) == ("crash", 0, 1,
                                                                                True)
    assert {p: r[f"{p}_s"] for p in PHASES} == pytest.approx(FULL, abs=1e-3)
    assert (r["last_step"], r["resumed_step"], r["steps_lost"]) == (12, 10, 2)
    assert r["step_time_s"] == pytest.approx(0.1) and r["lost_s"] == pytest.approx(3.5)


def test_a_relaunch_that_fails_before_a_step_ends_its_recovery_and_starts_the_next():
    again = _events(
        ("exit", 104.05, {"attempt": 1, "last_step": 10, "reported_at": 104.0,
                          "exited_at": 104.02}),
        ("classification", 104.03, {"attempt": 1, "failure": "data"}),
        ("decision", 104.04, {"attempt": 1, "action": "relaunch", "backoff_s": 0.0}),
        ("launch", 104.1, {"attempt": 2, "resume_from": "/c/checkpoint-10", "spawn_at": 104.09,
                           "spawn_s": 0.005}))
    relaunch_2 = [_hb(105.0, "start", started=104.09), _hb(105.5, "start", step=10,
                                                            restore_s=0.4),
                  _hb(105.7, step=11)]
    got = _track([*FAIL, *again], {("launch", 0): STEPS_0, ("launch", 1): RELAUNCH[:2],
                                   ("launch", 2): relaunch_2})
    assert [(r["failure"], r["attempt"], r["complete"]) for r in got] == [
        ("crash", 1, False), ("data", 2, True)]
    assert got[0]["total_s"] == pytest.approx(4.0) and got[0]["first_step_s"] is None
    assert got[0]["steps_lost"] == 2
    assert got[1]["total_s"] == pytest.approx(1.7) and got[1]["steps_lost"] == 0
    assert got[1]["step_time_s"] == pytest.approx(0.1)  # attempt 1 had no steps: the run's


@pytest.mark.parametrize("events, heartbeats", [
    (FAIL, {("launch", 0): STEPS_0}),  # no heartbeat from the relaunch: nothing to measure
    ([*FAIL[:3], {"kind": "decision", "time": 100.22, "attempt": 0, "action": "give_up",
                  "backoff_s": 0.0}], {("launch", 0): STEPS_0}),
    (FAIL, {("launch", 0): STEPS_0, ("launch", 1): [_hb(103.3, step=11, rank=1)]}),  # rank 1
])
def test_no_recovery_without_a_relaunch_or_its_heartbeats(events, heartbeats):
    done = [*events, {"kind": "exit", "time": 200.0, "attempt": 1, "last_step": None,
                      "exited_at": 200.0}]
    assert _track(done, heartbeats) == []


def test_costs_by_kind_folds_each_phase_and_orders_by_time_lost():
    full = breakdown(BASE)
    killed = breakdown(replace(BASE, reported_at=None))
    hang = breakdown(replace(BASE, failure="hang", reported_at=None, hang_at=80.2,
                             restored_step=5))
    costs = costs_by_kind([full, killed, hang])
    assert [(c.kind, c.count, c.steps_lost) for c in costs] == [("hang", 1, 7), ("crash", 2, 4)]
    crash = costs[1]
    assert crash.lost_s == pytest.approx(3.5 + 3.3)
    assert crash.phases["teardown"] == pytest.approx((0.2, 0.2))  # only one measured it
    assert crash.phases["imports"] == pytest.approx((2.49, 1.245))
    assert crash.phases["total"] == pytest.approx((6.4, 3.2))
    assert costs_by_kind([]) == []


@pytest.mark.parametrize("value, text", [(None, "-"), (0.0034, "3 ms"), (0.41, "410 ms"),
                                         (2.634, "2.63 s"), (125, "2m05s"), (7500, "2h05m")])
def test_seconds(value, text):
    assert seconds(value) == text


def test_describe_says_every_phase_measured_and_the_steps():
    assert describe(breakdown(replace(BASE, reported_at=None))) == (
        "crash of attempt 0: 3.1 s to the first step of attempt 1 (detection 10 ms, decision "
        "40 ms, backoff 1 s, spawn 5 ms, imports 1.25 s, restore 500 ms, first step 300 ms); "
        "2 steps run again (200 ms)")
    unfinished = describe(breakdown(replace(BASE, first_step_at=None, ended_at=104.0)))
    assert unfinished.startswith("crash of attempt 0: attempt 1 ended 4 s later, before a step")


@pytest.fixture
def recovered(tmp_path):
    """A run whose attempt 0 crashed and was relaunched, with the recovery recorded."""
    run = tmp_path / "run"
    r = breakdown(BASE)
    write_events(run, [
        ("launch", {"attempt": 0, "argv": ["t.py"], "settings": {}, "level": 0,
                    "resume_from": None, "pid": 1, "ckpt_dir": "checkpoints"}),
        ("exit", {"attempt": 0, "returncode": 1, "signal": None, "duration_s": 9.0,
                  "last_step": 12, "exited_at": 100.2}),
        ("classification", {"attempt": 0, "failure": "crash", "reason": "boom"}),
        ("decision", {"attempt": 0, "action": "relaunch", "reason": "again", "backoff_s": 1.0,
                      "level": 0, "settings": {}, "exit_code": None, "resume": "latest"}),
        ("launch", {"attempt": 1, "argv": ["t.py"], "settings": {}, "level": 0,
                    "resume_from": "checkpoints/checkpoint-10", "pid": 2,
                    "ckpt_dir": "checkpoints", "spawn_at": 101.25, "spawn_s": 0.005}),
        ("recovery", r),
    ])
    return run, r


def test_status_shows_the_last_recovery_on_one_line(recovered):
    run, r = recovered
    s = summarize(run)
    assert s.recovery == r and s.time_lost_s == pytest.approx(3.5)
    lines = [line for line in render_text(s).splitlines() if "last recovery:" in line]
    assert len(lines) == 1 and lines[0].split("last recovery:")[1].strip() == describe(r)
    assert to_json(s)["recovery"]["imports_s"] == pytest.approx(1.245)


def test_report_has_a_time_lost_table_per_kind(recovered):
    run, _ = recovered
    rep = gather(run)
    assert [(c.kind, c.count, c.steps_lost) for c in rep.failure_costs] == [("crash", 1, 2)]
    page = render(rep)
    assert "<h2>Time lost to failures</h2>" in page
    row = page.split('<tr data-failure="crash">')[1].split("</tr>")[0]
    assert "<b>3.5 s</b>" in row and "1.25 s (1.25 s)" in row and "<td>2</td>" in row


def test_metrics_file_has_seconds_lost_per_kind_and_the_last_phases(recovered):
    run, _ = recovered
    from rtrain.supervisor.records.events import read_events

    m = MetricsFile(run / "m.prom", run_dir=run, ckpt_dir=run / "checkpoints")
    for e in read_events(run / "events.jsonl"):
        m.seed(e)
    text = m.render()
    assert f'rtrain_failure_seconds_lost_total{{run_dir="{run}",kind="crash"}} 3.5' in text
    assert f'rtrain_last_recovery_seconds{{run_dir="{run}",phase="imports"}} 1.245' in text
    assert f'rtrain_last_recovery_seconds{{run_dir="{run}",phase="total"}} 3.3' in text


def test_restore_tells_the_supervisor_how_long_the_load_took(tmp_path, monkeypatch):
    import torch

    import rtrain
    from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver

    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv("RTRAIN_HEARTBEAT", receiver.name)
        first = rtrain.Checkpointer(model=torch.nn.Linear(4, 4), ckpt_dir=tmp_path, keep=None)
        assert first.restore() == 0  # fresh: no step, which would say training started
        first.save(3)
        first.close()
        second = rtrain.Checkpointer(model=torch.nn.Linear(4, 4), ckpt_dir=tmp_path)
        assert second.restore() == 3
        got = receiver.drain()
    assert [(hb.event, hb.step) for hb in got if hb.restore_s is not None] == [
        ("start", None), ("start", 3)]
    assert all(0 < hb.restore_s < 30 for hb in got if hb.restore_s is not None)
    assert got[0].event == "start" and got[0].started is not None  # the install's, first
