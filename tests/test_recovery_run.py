"""What a failure cost, from a real supervised run: a crash injected at step 13 of a torch script
that keeps its own log (tests/children/recovery_train.py), relaunched from checkpoint-10 at once
(the crash followed progress, so the 0.3 s backoff set here is not waited). The `recovery`
event's phases are checked against the run's own events and against the wall time the script
itself saw, and `rtrain status` / `rtrain report` show them."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess

import pytest
import tuned
from harness import CHILDREN, child_env, events, invoke_rtrain, rtrain_cmd

from rtrain.supervisor.records.recovery import PHASES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def crashed_run(tmp_path_factory):
    """The run every test here reads, made once per pytest session: under pytest-xdist these
    tests land on several workers, each with its own session fixtures, so the first makes it
    in the session's shared temporary dir while the others wait on a lock, then read it (as
    test_trackers_launch.py's `tracked`)."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # every worker's basetemp is a folder of the session's
    base = shared / "recovery"
    run, log, result = base / "run", base / "train.log", base / "launch.json"
    with open(shared / "recovery.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            shutil.rmtree(base, ignore_errors=True)  # a worker that died half-way
            base.mkdir()
            tuned.write(base, {"backoff": {"initial_s": 0.3, "jitter": 0.0}})
            r = subprocess.run(rtrain_cmd("launch", "--run-dir", str(run), "-q",
                                          str(CHILDREN / "recovery_train.py"), "20", str(log)),
                               cwd=base, env=child_env(RTRAIN_FAULTS="crash@step=13"),
                               capture_output=True, text=True, timeout=180)
            result.write_text(json.dumps({"returncode": r.returncode, "stderr": r.stderr}))
    launched = json.loads(result.read_text())
    assert launched["returncode"] == 0, launched["stderr"]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return run, lines


def test_each_phase_is_measured_in_order_and_they_add_up_to_what_the_script_saw(crashed_run):
    run, lines = crashed_run
    [r] = events(run, "recovery")
    assert (r["failure"], r["failed_attempt"], r["attempt"], r["complete"]) == ("crash", 0, 1,
                                                                                True)
    phases = {p: r[f"{p}_s"] for p in PHASES}
    # The crash came after a newer checkpoint (progress): the policy relaunches at once.
    assert phases.pop("backoff") == 0.0 and r["backoff_s"] == 0.0
    assert all(v is not None and v > 0 for v in phases.values()), phases
    assert sum(phases.values()) == pytest.approx(r["total_s"], abs=2e-3)

    # The moments behind the phases come in order: exit record, exit, classification, the
    # spawn and its exec, the script's restore, its first step.
    [exit0, _] = events(run, "exit")
    [classified] = events(run, "classification")
    launch1 = events(run, "launch")[1]
    resumed = next(x for x in lines if x["attempt"] == "1" and "resumed" in x)
    first = next(x for x in lines if x["attempt"] == "1" and "step" in x)
    crash = next(x for x in lines if "crash" in x)
    moments = [crash["time"], exit0["reported_at"], exit0["exited_at"], classified["time"],
               launch1["spawn_at"], launch1["spawn_at"] + launch1["spawn_s"], resumed["time"],
               first["time"]]
    assert moments == sorted(moments), moments
    # The failure's moment is the worker's `exception` heartbeat, sent as the excepthook began,
    # before the exit record it then wrote.
    record = json.loads((run / "attempts" / "0" / "exit-rank0.json").read_text())
    assert crash["time"] <= exit0["reported_at"] <= record["time"]

    # From the crash to the first resumed step, by the script's own clock and log.
    seen = first["time"] - crash["time"]
    assert r["total_s"] == pytest.approx(seen, abs=0.1 + 0.05 * seen)


def test_steps_lost_are_those_the_script_ran_twice(crashed_run):
    run, lines = crashed_run
    [r] = events(run, "recovery")
    last = max(x["step"] for x in lines if x["attempt"] == "0" and "step" in x)
    resumed = next(x["resumed"] for x in lines if x["attempt"] == "1" and "resumed" in x)
    assert (last, resumed) == (12, 10)  # crash at 13, a checkpoint every 5 steps
    assert (r["last_step"], r["resumed_step"], r["steps_lost"]) == (last, resumed,
                                                                    last - resumed)
    assert 0.04 < r["step_time_s"] < 1.0  # 0.05 s of sleep per step, plus the step
    assert r["work_lost_s"] == pytest.approx(r["steps_lost"] * r["step_time_s"], abs=1e-3)
    assert r["lost_s"] == pytest.approx(r["total_s"] + r["work_lost_s"], abs=1e-3)


def test_status_and_report_show_it(crashed_run, tmp_path):
    run, _ = crashed_run
    out = invoke_rtrain("status", str(run))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if "last recovery:" in x)
    assert "crash of attempt 0:" in line and "to the first step of attempt 1" in line
    assert "imports" in line and "2 steps run again" in line
    page = tmp_path / "report.html"
    assert invoke_rtrain("report", str(run), "-o", str(page)).returncode == 0
    html = page.read_text()
    assert "<h2>Time lost to failures</h2>" in html and '<tr data-failure="crash">' in html
