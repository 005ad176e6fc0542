"""The supervisor itself stopped (SIGTERM) or killed (SIGKILL) mid-run: launching the same
command again finishes the run bitwise-identical to an uninterrupted one."""

from __future__ import annotations

import signal
import time

import pytest
from chaos_util import (
    final_state_diff,
    launch_chaos,
    leftovers,
    reference,
    replayed_steps,
    start_chaos,
    starts,
    step_log,
    wait_for_step,
    wait_gone,
    write_config,
)
from harness import events, gone

from rtrain.supervisor.records.runstate import load_state

SETTINGS = {"steps": 50, "save_every": 10, "step_sleep": 0.02}
GRACE_S = 20.0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [pytest.param(0, marks=pytest.mark.soak), 2],
                         ids=["no-workers", "loader-workers"])
def test_preemption_exits_75_in_the_grace_and_resumes_with_no_lost_step(tmp_path, workers):
    # With DataLoader workers, the stop signal sent to the process group reaches them too: they
    # must leave it to the training process (which saves at the step boundary), not die of it.
    settings = {**SETTINGS, "workers": workers}
    ref = reference(tmp_path, settings)
    write_config(tmp_path / "rtrain.toml", settings, grace_s=GRACE_S)
    run = tmp_path / "run"
    proc = start_chaos(run)
    wait_for_step(run, 25, proc=proc)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=GRACE_S + 30)
    took = time.monotonic() - t0
    assert proc.returncode == 75, err[-3000:]
    assert took < GRACE_S, f"rtrain took {took:.1f} s to stop, the grace is {GRACE_S:g} s"
    assert [e["name"] for e in events(run, "signal")] == ["SIGTERM"]
    assert events(run, "exit")[0]["returncode"] == 75  # the child saved and exited 75 itself
    assert events(run, "decision")[-1]["action"] == "exit_preempted"
    assert load_state(run).status.value == "preempted"
    last = max(r["step"] for r in step_log(run) if "step" in r)
    assert last < settings["steps"], "the run ended before the stop reached it"

    r = launch_chaos(run)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = starts(step_log(run))[-1]
    assert resumed["a"] == 1 and resumed["start"] == last, "resume is not at the last step run"
    assert resumed["resume_from"].endswith(f"/checkpoint-{last}")
    first = next(r["step"] for r in step_log(run) if r.get("a") == 1 and "step" in r)
    assert first == last + 1
    assert replayed_steps(step_log(run)) == 0, "steps were executed twice: work was lost"
    assert final_state_diff(run, ref) is None
    assert wait_gone(str(run)) == []


@pytest.mark.slow
def test_supervisor_sigkilled_takes_the_child_along_and_the_next_launch_resumes(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    write_config(tmp_path / "rtrain.toml", SETTINGS)
    run = tmp_path / "run"
    proc = start_chaos(run)
    wait_for_step(run, 35, proc=proc)
    child = events(run, "launch")[0]["pid"]
    proc.kill()
    proc.wait(timeout=30)
    assert gone(child, timeout=10), "the child outlived its SIGKILLed supervisor"
    assert wait_gone(str(run)) == [], [p.cmdline() for p in leftovers(str(run))]
    assert list((run / "checkpoints").glob("checkpoint-*")), "no checkpoint to resume from"

    r = launch_chaos(run)
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(run, "lock_takeover"), "the stale lock was not reported as taken over"
    resumed = starts(step_log(run))[-1]
    assert resumed["a"] == 1 and resumed["start"] >= 30 and resumed["verified_full"] is True
    assert final_state_diff(run, ref) is None
    assert wait_gone(str(run)) == []
