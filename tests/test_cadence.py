"""every="auto": the pure interval (worker/saving/cadence.py) by table, the save clock that feeds
it, the supervisor's failure record (timeline, child env) and what `rtrain status` shows."""

from __future__ import annotations

import contextlib
import json
import math
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from rtrain.supervisor.commands.status import render_text, summarize
from rtrain.supervisor.core import protocol
from rtrain.supervisor.launch import child_env
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.records.timeline import Timeline
from rtrain.worker.saving import cadence, save_clock
from rtrain.worker.saving.cadence import CadenceBounds, Mtbf
from rtrain.worker.saving.schedule import SaveSchedule

PRIOR = cadence.mtbf(None, None)
DAY = 86400.0


@pytest.mark.parametrize("failures, run_s, seconds, source, observed", [
    (None, None, DAY, "prior", False),  # run by hand
    (0, 3600.0, DAY, "prior", False),
    (0, 2.5 * DAY, 2.5 * DAY, "none in 2.5 d", False),  # went longer than the prior
    (2, 6 * 3600.0, 3 * 3600.0, "2 failures in 6 h", True),
    (1, 40 * 60.0, 40 * 60.0, "1 failure in 40 min", True),  # the prior is not blended in
    (1, 4.0, cadence.MIN_MTBF_S, "1 failure in 4 s", True),  # mostly start-up: floored
    (1, 30.0, 30.0, "1 failure in 30 s", True),
    (3, None, cadence.MIN_MTBF_S, "3 failures in 0 s", True),
])
def test_mtbf(failures, run_s, seconds, source, observed):
    assert cadence.mtbf(failures, run_s) == Mtbf(seconds=seconds, source=source,
                                                  observed=observed)


@pytest.mark.parametrize("fall, factor", [
    (None, 1.0),  # no loss reported
    (0.01, 1.0),  # the reference: a 1 % fall per interval
    (0.04, 0.5), (1.0, 0.5),  # fast, bounded
    (0.005, math.sqrt(2)),
    (0.0025, 2.0), (0.0, 2.0), (-0.1, 2.0),  # a plateau or a rising loss, bounded
])
def test_loss_factor(fall, factor):
    assert cadence.loss_factor(fall) == pytest.approx(factor)


def test_loss_trend():
    falling = [(s, 10 - 0.01 * s) for s in range(100)]
    assert cadence.loss_trend(falling) == pytest.approx((0.5 / 9.755) / 50)
    assert cadence.loss_trend([(s, 2.0) for s in range(20)]) == 0.0
    rising = [(s, 1 + s) for s in range(20)]
    assert cadence.loss_trend(rising) < 0
    assert cadence.loss_trend(falling[:7]) is None  # too few
    assert cadence.loss_trend([(5, 1.0)] * 10) is None  # no steps between the halves
    nan = [(s, math.nan) for s in range(50)] + falling[:7]
    assert cadence.loss_trend(nan) is None  # non-finite losses do not count


# stall, step time, MTBF, loss per step, bounds -> every_steps, the reason's tail
CASES = [
    # sqrt(2 * 0.05 * 86400) = 92.95 s = 929 steps of 0.1 s
    (0.05, 0.1, PRIOR, None, CadenceBounds(), 929,
     "every 929 steps: save stall 0.05 s, MTBF 24 h (prior)"),
    # observed MTBF 3 h: sqrt(2 * 0.05 * 10800) = 32.9 s
    (0.05, 0.1, cadence.mtbf(2, 6 * 3600.0), None, CadenceBounds(), 328,
     "every 328 steps: save stall 0.05 s, MTBF 3 h (2 failures in 6 h)"),
    # a bigger stall, a longer interval: sqrt(2 * 2 * 86400) = 587.9 s
    (2.0, 1.0, PRIOR, None, CadenceBounds(), 587,
     "every 587 steps: save stall 2 s, MTBF 24 h (prior)"),
    # 2276 s wanted, 30 min allowed
    (30.0, 1.0, PRIOR, None, CadenceBounds(), 1800,
     "every 1,800 steps: save stall 30 s, MTBF 24 h (prior); capped at 30 min between saves"),
    (0.05, 0.1, PRIOR, None, CadenceBounds(max_steps=500), 500,
     "every 500 steps: save stall 0.05 s, MTBF 24 h (prior); capped at max_steps 500"),
    (0.001, 1.0, cadence.mtbf(5, 10.0), None, CadenceBounds(min_steps=10), 10,
     "every 10 steps: save stall 0.001 s, MTBF 10 s (5 failures in 10 s); raised to "
     "min_steps 10"),
    # a 4 % fall over 929 steps: half as long
    (0.05, 0.1, PRIOR, 0.04 / 929.5, CadenceBounds(), 464,
     "every 464 steps: save stall 0.05 s, MTBF 24 h (prior); loss falling fast: x0.5"),
    # a plateau: twice as long, then the 30 min cap
    (1.0, 1.0, PRIOR, 0.0, CadenceBounds(), 831,
     "every 831 steps: save stall 1 s, MTBF 24 h (prior); loss flat: x2"),
    (5.0, 1.0, PRIOR, 0.0, CadenceBounds(), 1800,
     "every 1,800 steps: save stall 5 s, MTBF 24 h (prior); loss flat: x2; capped at 30 min "
     "between saves"),
    # a save that cost nothing measurable: the smallest interval
    (0.0, 0.1, PRIOR, None, CadenceBounds(), 1,
     "every 1 step: save stall 0 s, MTBF 24 h (prior)"),
]


@pytest.mark.parametrize("stall, step_time, mtbf, trend, bounds, steps, reason", CASES)
def test_interval(stall, step_time, mtbf, trend, bounds, steps, reason):
    c = cadence.interval(save_stall_s=stall, step_time_s=step_time, mtbf=mtbf,
                         loss_per_step=trend, bounds=bounds)
    assert (c.every_steps, c.reason) == (steps, reason)
    assert c.expected_loss_s == pytest.approx(steps * step_time / 2)
    assert (c.save_stall_s, c.mtbf_s, c.mtbf_source) == (stall, mtbf.seconds, mtbf.source)


def test_more_failures_never_lengthen_the_interval():
    steps = [cadence.interval(save_stall_s=0.2, step_time_s=0.05, mtbf=cadence.mtbf(n, 8 * 3600),
                              loss_per_step=None, bounds=CadenceBounds()).every_steps
             for n in range(8)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


# bounds, MTBF -> the first schedule before any save is measured: every_steps, seconds, reason
FIRST = [
    # a fresh run: step 2 (one timed step after the warm-up one), at most 10 min in
    (CadenceBounds(), PRIOR, 2, 600.0,
     "saving every 2 steps until a save is measured, at most 10 min apart"),
    (CadenceBounds(min_steps=50), PRIOR, 50, 600.0,
     "saving every 50 steps until a save is measured, at most 10 min apart; raised to "
     "min_steps 50"),
    (CadenceBounds(max_steps=1), PRIOR, 1, 600.0,
     "saving every 1 step until a save is measured, at most 10 min apart; capped at "
     "max_steps 1"),
    (CadenceBounds(max_seconds=60.0), PRIOR, 2, 60.0,
     "saving every 2 steps until a save is measured, at most 1 min apart"),
    # the run went long without failing: no reason to wait longer or shorter
    (CadenceBounds(), cadence.mtbf(0, 3 * DAY), 2, 600.0,
     "saving every 2 steps until a save is measured, at most 10 min apart"),
    # failures before any save: half the observed MTBF
    (CadenceBounds(), cadence.mtbf(3, 12.0), 2, 5.0,
     "saving every 2 steps until a save is measured, at most 5 s apart; half the MTBF 10 s "
     "(3 failures in 12 s)"),
    (CadenceBounds(), cadence.mtbf(2, 240.0), 2, 60.0,
     "saving every 2 steps until a save is measured, at most 1 min apart; half the MTBF "
     "2 min (2 failures in 4 min)"),
    (CadenceBounds(min_steps=10), cadence.mtbf(1, 3600.0), 10, 600.0,  # rare: 10 min holds
     "saving every 10 steps until a save is measured, at most 10 min apart; raised to "
     "min_steps 10"),
]


@pytest.mark.parametrize("bounds, mtbf, steps, seconds, reason", FIRST)
def test_first_save(bounds, mtbf, steps, seconds, reason):
    first = cadence.first_save(bounds, mtbf)
    assert (first.every_steps, first.every_seconds, first.reason) == (steps, seconds, reason)


def test_more_failures_never_delay_the_first_save():
    firsts = [cadence.first_save(CadenceBounds(), cadence.mtbf(n, 600.0)) for n in range(8)]
    assert {f.every_steps for f in firsts} == {cadence.FIRST_SAVE_STEPS}
    seconds = [f.every_seconds for f in firsts]
    assert seconds == sorted(seconds, reverse=True) and seconds[0] > seconds[-1]


@pytest.mark.parametrize("kwargs, message", [
    ({"min_steps": 0}, "min_steps must be at least 1"),
    ({"min_steps": 10, "max_steps": 5}, "max_steps .5. must be at least min_steps .10."),
    ({"max_seconds": 0}, "max_seconds must be positive"),
])
def test_bounds_say_what_to_change(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CadenceBounds(**kwargs)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run_between_saves(c: save_clock.SaveClock, t: FakeClock, first: int, last: int) -> None:
    for step in range(first, last + 1):
        t.now += 0.1
        c.tick(step, loss=5.0, samples=None, epoch_end=False)


def test_save_clock_chooses_after_each_save_and_follows_the_failures(monkeypatch):
    beats = []
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: beats.append(kw))
    monkeypatch.delenv(protocol.ENV_FAILURES, raising=False)
    monkeypatch.delenv(protocol.ENV_RUN_SECONDS, raising=False)
    t = FakeClock()
    c = save_clock.SaveClock(SaveSchedule(every_steps=50, every_seconds=1800.0), clock=t,
                             bounds=CadenceBounds())
    run_between_saves(c, t, 1, 50)
    c.save_begins(50)
    t.now += 0.05
    c.save_ended(50, stall_s=0.05)
    # 49 steps timed in 4.9 s; a flat loss doubles the prior's 929 steps
    assert c.cadence.step_time_s == pytest.approx(0.1)
    assert c.schedule.every_steps in (1858, 1859)  # as 0.1 s rounds
    assert c.schedule.every_seconds == 1800.0
    beat = beats[-1]
    assert beat["event"] == "cadence" and beat["step"] == 50
    assert beat["cadence"]["every_steps"] == c.schedule.every_steps
    assert beat["cadence"]["mtbf_source"] == "prior"

    monkeypatch.setenv(protocol.ENV_FAILURES, "2")
    monkeypatch.setenv(protocol.ENV_RUN_SECONDS, "7200")
    run_between_saves(c, t, 51, 100)
    c.save_begins(100)
    c.save_ended(100, stall_s=0.05)
    assert c.cadence.mtbf_source == "2 failures in 2 h"
    # sqrt(2 * 0.05 * 3600) = 18.97 s = 189.7 steps, doubled on the flat loss
    assert c.schedule.every_steps in (379, 380)


def test_a_relaunch_chooses_its_first_interval_from_the_runs_measured_cost(monkeypatch):
    beats = []
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: beats.append(kw))
    monkeypatch.setenv(protocol.ENV_FAILURES, "1")
    monkeypatch.setenv(protocol.ENV_RUN_SECONDS, "3600")
    monkeypatch.setenv(protocol.ENV_SAVE_COST, '{"save_stall_s": 0.05, "step_time_s": 0.1}')
    t = FakeClock()
    first_guess = SaveSchedule(every_steps=5000, every_seconds=1800.0)
    c = save_clock.SaveClock(first_guess, clock=t, bounds=CadenceBounds())
    # sqrt(2 * 0.05 * 3600) = 18.97 s = 189 steps of 0.1 s, no loss trend yet: chosen at once
    assert c.schedule.every_steps == 189 and c.cadence.mtbf_source == "1 failure in 1 h"
    assert beats == []  # reported with the first step, which the supervisor records it at
    c.tick(701, loss=None, samples=None, epoch_end=False)
    assert beats[0]["event"] == "cadence" and beats[0]["step"] == 701
    assert beats[0]["cadence"]["every_steps"] == 189
    c.tick(702, loss=None, samples=None, epoch_end=False)
    assert [b.get("event") for b in beats] == ["cadence", None, None]


def test_a_relaunch_with_no_measured_cost_saves_early_and_soon(monkeypatch, caplog):
    """Its earlier attempts died before any save: no RTRAIN_SAVE_COST, but the failures count.
    The first schedule saves at step 2, at most half the observed MTBF in; that save then
    chooses from the failures."""
    beats = []
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: beats.append(kw))
    monkeypatch.setenv(protocol.ENV_FAILURES, "2")
    monkeypatch.setenv(protocol.ENV_RUN_SECONDS, "40")
    monkeypatch.delenv(protocol.ENV_SAVE_COST, raising=False)
    with caplog.at_level("INFO", logger=save_clock.__name__):
        first = save_clock.first_schedule(CadenceBounds(), on_epoch_end=True)
    assert first == SaveSchedule(every_steps=2, every_seconds=10.0, on_epoch_end=True)
    assert ("save cadence: saving every 2 steps until a save is measured, at most 10 s apart; "
            "half the MTBF 20 s (2 failures in 40 s)") in caplog.messages
    t = FakeClock()
    c = save_clock.SaveClock(first, clock=t, bounds=CadenceBounds())
    assert c.cadence is None and beats == []  # nothing measured to choose from yet
    t.now += 0.1
    assert not c.tick(1, loss=None, samples=None, epoch_end=False)
    t.now += 0.1
    assert c.tick(2, loss=None, samples=None, epoch_end=False)
    c.save_begins(2)
    c.save_ended(2, stall_s=0.05)
    # sqrt(2 * 0.05 * 20) = 1.41 s = 14 steps of 0.1 s
    assert c.cadence.mtbf_source == "2 failures in 40 s" and c.schedule.every_steps == 14
    assert beats[-1]["event"] == "cadence" and beats[-1]["step"] == 2


def test_a_skipped_first_save_falls_back_to_its_time_limit(monkeypatch):
    """The save at step 2 was skipped (a full disk): not retried every 2 steps, but after the
    first schedule's time limit; the save that then succeeds chooses the interval."""
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: None)
    monkeypatch.delenv(protocol.ENV_FAILURES, raising=False)
    t = FakeClock()
    c = save_clock.SaveClock(save_clock.first_schedule(CadenceBounds(), False), clock=t,
                             bounds=CadenceBounds())
    run_between_saves(c, t, 1, 1)
    t.now += 0.1
    assert c.tick(2, loss=None, samples=None, epoch_end=False)
    c.save_begins(2)  # ... and no save_ended: skipped
    due = []
    for step in range(3, 30):
        t.now += 0.1
        due.append(c.tick(step, loss=None, samples=None, epoch_end=False))
    assert not any(due) and c.schedule.every_steps is None
    t.now += cadence.FIRST_SAVE_S
    assert c.tick(30, loss=None, samples=None, epoch_end=False)
    c.save_begins(30)
    c.save_ended(30, stall_s=0.05)
    assert c.cadence is not None and c.schedule.every_steps == c.cadence.every_steps


def test_a_first_step_slower_than_half_the_mtbf_is_saved_at_once(monkeypatch):
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: None)
    monkeypatch.setenv(protocol.ENV_FAILURES, "4")
    monkeypatch.setenv(protocol.ENV_RUN_SECONDS, "200")  # MTBF 50 s: save within 25 s
    t = FakeClock()
    c = save_clock.SaveClock(save_clock.first_schedule(CadenceBounds(), False), clock=t,
                             bounds=CadenceBounds())
    t.now += 30.0
    assert c.tick(1, loss=None, samples=None, epoch_end=False)


@pytest.mark.parametrize("value", ["", "{}", "[1, 2]", '{"save_stall_s": 0.1}',
                                   '{"save_stall_s": "x", "step_time_s": 0.1}',
                                   '{"save_stall_s": 0.1, "step_time_s": 0}',
                                   '{"save_stall_s": NaN, "step_time_s": 0.1}'])
def test_a_cost_that_does_not_parse_keeps_the_first_guess(monkeypatch, value):
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: None)
    monkeypatch.setenv(protocol.ENV_SAVE_COST, value)
    c = save_clock.SaveClock(SaveSchedule(every_steps=50), clock=FakeClock(),
                             bounds=CadenceBounds())
    assert c.schedule.every_steps == 50 and c.cadence is None


def test_save_clock_keeps_a_fixed_schedule(monkeypatch):
    monkeypatch.setattr(save_clock.runtime, "heartbeat", lambda **kw: None)
    t = FakeClock()
    c = save_clock.SaveClock(SaveSchedule(every_steps=10), clock=t)
    run_between_saves(c, t, 1, 10)
    c.save_begins(10)
    c.save_ended(10, stall_s=5.0)
    assert c.schedule.every_steps == 10 and c.cadence is None


def test_timeline_counts_the_runs_work_losing_failures_and_time():
    tl = Timeline()
    events = [("launch", 0), ("exit", 0, 100.0), ("classification", 0, "crash"),
              ("launch", 1), ("exit", 1, 50.0), ("classification", 1, "preempted"),
              ("launch", 2), ("exit", 2, 3.0), ("classification", 2, "startup"),
              ("launch", 3), ("exit", 3, 20.0), ("classification", 3, "oom_gpu"),
              ("launch", 4), ("exit", 4, float("nan"))]
    for kind, attempt, *rest in events:
        event = {"kind": kind, "attempt": attempt}
        if kind == "exit":
            event["duration_s"] = rest[0]
        elif kind == "classification":
            event["failure"] = rest[0]
        tl.add(event)
    assert (tl.work_lost, tl.run_s) == (2, 173.0)
    tl.add({"kind": "launch", "attempt": 0})  # --fresh: the new run's own record
    assert (tl.work_lost, tl.run_s) == (0, 0.0)


def test_timeline_keeps_the_newest_measured_save_cost_of_the_current_run():
    tl = Timeline()
    tl.add({"kind": "launch", "attempt": 0})
    assert tl.save_cost is None
    for stall in (0.2, 0.05):
        tl.add({"kind": "cadence", "attempt": 0, "step": 10, "save_stall_s": stall,
                "step_time_s": 0.1, "every_steps": 40})
    assert tl.save_cost == {"save_stall_s": 0.05, "step_time_s": 0.1}
    tl.add({"kind": "cadence", "attempt": 0, "step": 20, "save_stall_s": None,
            "step_time_s": 0.1})
    assert tl.save_cost is None  # a damaged event is no measurement
    tl.add({"kind": "cadence", "attempt": 0, "step": 30, "save_stall_s": 0.05,
            "step_time_s": 0.1})
    tl.add({"kind": "launch", "attempt": 0})  # --fresh: the new run measures its own
    assert tl.save_cost is None


def test_the_child_is_given_the_failure_record(tmp_path):
    plan = child_env.AttemptPlan(attempt=3, settings={}, resume_from=None, run_dir=tmp_path,
                                 ckpt_dir=tmp_path / "c", attempt_dir=tmp_path / "a",
                                 failures=2, run_s=7200.04)
    env = child_env.environment(plan, stop_signal="SIGTERM", heartbeat_addr="@x",
                                dump_signal=12, relieve_signal=23, file_mode=0o600, base={})
    assert (env[protocol.ENV_FAILURES], env[protocol.ENV_RUN_SECONDS]) == ("2", "7200.0")
    assert protocol.ENV_SAVE_COST not in env
    costed = child_env.AttemptPlan(attempt=3, settings={}, resume_from=None, run_dir=tmp_path,
                                   ckpt_dir=tmp_path / "c", attempt_dir=tmp_path / "a",
                                   save_cost={"save_stall_s": 0.05, "step_time_s": 0.1})
    env = child_env.environment(costed, stop_signal="SIGTERM", heartbeat_addr="@x",
                                dump_signal=12, relieve_signal=23, file_mode=0o600, base={})
    assert json.loads(env[protocol.ENV_SAVE_COST]) == {"save_stall_s": 0.05, "step_time_s": 0.1}
    unknown = child_env.AttemptPlan(attempt=3, settings={}, resume_from=None, run_dir=tmp_path,
                                    ckpt_dir=tmp_path / "c", attempt_dir=tmp_path / "a")
    env = child_env.environment(unknown, stop_signal="SIGTERM", heartbeat_addr="@x",
                                dump_signal=12, relieve_signal=23, file_mode=0o600,
                                base={protocol.ENV_FAILURES: "9"})  # from an outer run
    assert protocol.ENV_FAILURES not in env and protocol.ENV_RUN_SECONDS not in env


def test_status_shows_the_cadence_and_the_work_a_failure_loses(tmp_path: Path):
    run_dir = tmp_path / "run"
    clock = iter(1_700_000_000.0 + i for i in range(100))
    launch = {"argv": ["t"], "settings": {}, "level": 0, "resume_from": None, "pid": 1,
              "ckpt_dir": "checkpoints"}
    c = cadence.interval(save_stall_s=0.05, step_time_s=0.1, mtbf=cadence.mtbf(2, 6 * 3600.0),
                         loss_per_step=None, bounds=CadenceBounds())
    with EventLog(run_dir / "events.jsonl", clock=lambda: next(clock)) as log:
        log.emit("launch", attempt=0, **launch)
        log.emit("exit", attempt=0, returncode=1, signal=None, duration_s=60.0, last_step=60,
                 peak_rss_bytes=0, gpu_used_peak=None, gpu_total=None, leftovers=[])
        log.emit("launch", attempt=1, **launch)  # one second later: the restart
        log.emit("cadence", attempt=1, step=80, **{k: v for k, v in c.fields().items()})
    s = summarize(run_dir, now=1_700_000_010.0)
    assert s.cadence["every_steps"] == 328 and s.restart_s == 1.0
    text = render_text(s)
    assert ("save cadence: every 328 steps: save stall 0.05 s, MTBF 3 h (2 failures in 6 h)"
            in text)
    assert "expected work lost per failure: 164 steps (16s) + 1s restart" in text


@pytest.mark.slow
def test_the_interval_shrinks_after_failures_under_rtrain(tmp_path):
    """A run that crashes in attempts 0 and 1: attempt 0 chose from the 24 h prior, the later
    ones from the observed failures (seconds into the run), so their interval is much shorter,
    and chosen at their first step from the cost attempt 0 measured, not guessed again until
    their first save; `rtrain status` shows the last one and the work it risks."""
    from harness import CHILDREN, events, launch, run_rtrain

    run_dir = tmp_path / "run"
    done = launch(run_dir, "--", sys.executable, str(CHILDREN / "auto_cadence.py"), "60",
                  env={"RTRAIN_FAULTS": "crash@step=10,attempt=0; crash@step=16,attempt=1"},
                  timeout=120)
    assert done.returncode == 0, done.stderr
    chosen = {}
    for e in events(run_dir, "cadence"):
        chosen.setdefault(e["attempt"], e)  # each attempt's first choice
    assert sorted(chosen) == [0, 1, 2]
    assert chosen[0]["mtbf_source"] == "prior" and chosen[0]["mtbf_s"] == cadence.PRIOR_MTBF_S
    assert chosen[1]["mtbf_source"].startswith("1 failure in ")
    assert chosen[2]["mtbf_source"].startswith("2 failures in ")
    assert chosen[2]["mtbf_s"] < 60  # a few seconds a failure, or the floor
    for launched in events(run_dir, "launch")[1:]:
        # chosen at the relaunch's first step, from the cost attempt 0 measured
        resumed = int(Path(launched["resume_from"]).name.split("-")[1])
        assert chosen[launched["attempt"]]["step"] == resumed + 1
    # sqrt(86400 / 60) = 38 times shorter for the same stall; the stall may vary a few times
    assert chosen[1]["every_steps"] * 4 < chosen[0]["every_steps"]
    assert chosen[2]["every_steps"] * 4 < chosen[0]["every_steps"]

    status = run_rtrain("status", str(run_dir))
    assert status.returncode == 0, status.stderr
    last = events(run_dir, "cadence")[-1]
    assert re.search(rf"save cadence: +every {last['every_steps']:,} step", status.stdout)
    assert "(2 failures in " in status.stdout
    assert "expected work lost per failure:" in status.stdout


class KillAfterLaunch(threading.Thread):
    """SIGKILLs each of the first `planned` attempts of a run a random 2-6 s after its launch,
    but not before it finished two steps: on a loaded machine the imports alone can take 2 s,
    and a kill before the first steps leaves nothing any cadence could have saved."""

    def __init__(self, run_dir: Path, log: Path, planned: int, seed: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.log, self.planned = run_dir, log, planned
        self.rng = random.Random(seed)
        self.kills: list[tuple[int, float]] = []  # (attempt, seconds after its launch)
        self.done = threading.Event()

    def run(self) -> None:
        from chaos_util import Tail

        launches, steps = Tail(self.run_dir / "events.jsonl"), Tail(self.log)
        stepped: Counter[int] = Counter()  # steps each attempt finished
        while not self.done.is_set() and len(self.kills) < self.planned:
            for e in launches.read():
                if e["kind"] != "launch":
                    continue
                t0, delay = time.monotonic(), self.rng.uniform(2.0, 6.0)
                while not self.done.is_set():
                    stepped.update(r["a"] for r in steps.read())
                    if time.monotonic() - t0 >= delay and stepped[e["attempt"]] >= 2:
                        break
                    time.sleep(0.01)
                with contextlib.suppress(psutil.Error):
                    psutil.Process(e["pid"]).send_signal(signal.SIGKILL)
                    self.kills.append((e["attempt"], time.monotonic() - t0))
                if len(self.kills) >= self.planned:
                    return
            time.sleep(0.01)


@pytest.mark.slow
def test_three_kills_seconds_apart_from_a_fresh_start_do_not_end_the_run(tmp_path):
    """every="auto" alone, SIGKILLed three times 2-6 s after each launch: the
    first attempt saves after its first steps (measuring the save), each later one chooses a
    short interval from the failures, every attempt resumes from a newer checkpoint than the
    one before, and the run finishes instead of ending in "crash loop"."""
    from harness import CHILDREN, events, launch_cmd
    from harness import child_env as test_env

    run_dir, log = tmp_path / "run", tmp_path / "steps.jsonl"
    argv = launch_cmd(run_dir, "--", sys.executable, str(CHILDREN / "auto_plain.py"), "450",
                      "0.02", str(log))
    killer = KillAfterLaunch(run_dir, log, planned=3, seed=4)  # 2.9, 2.4, 3.6 s
    killer.start()
    proc = subprocess.Popen(argv, cwd=tmp_path, env=test_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        killer.done.set()
        if proc.poll() is None:
            proc.kill()
    give_up = [e["reason"] for e in events(run_dir, "give_up")]
    assert proc.returncode == 0, (give_up, err[-2000:])
    assert [a for a, _ in killer.kills] == [0, 1, 2], killer.kills
    assert [e["attempt"] for e in events(run_dir, "exit") if e["signal"] == "SIGKILL"] == [0, 1, 2]
    resumed = [None if e["resume_from"] is None else int(Path(e["resume_from"]).name.split("-")[1])
               for e in events(run_dir, "launch")]
    # Attempt 0 saved at step 2 to measure the save, then (24 h prior) not again so soon.
    assert resumed == [None, cadence.FIRST_SAVE_STEPS, *resumed[2:]], resumed
    first = events(run_dir, "cadence")[0]
    assert (first["attempt"], first["step"]) == (0, cadence.FIRST_SAVE_STEPS)
    assert first["mtbf_source"] == "prior"
    # The later attempts chose from the kills counted so far (none of them after a save of
    # their own: the supervisor counts kills before any save), so they saved seconds apart.
    for e in events(run_dir, "cadence"):
        if e["attempt"] > 0:
            assert e["mtbf_source"].startswith(f"{e['attempt']} failure"), e
            assert e["every_steps"] * 0.02 < 10, e
    assert resumed[1] <= resumed[2] <= resumed[3] and resumed[1] < resumed[3], resumed
