"""Saving before a Slurm job's time limit: the scheduler's times parsed, the margin learned from
measured stops and saves, the plan, and the stop carried out by the watch and the launch loop.
The run against a real one-node cluster is in tests/test_slurm.py."""

from __future__ import annotations

import calendar
import time

import pytest
from scripted_loop import Script, run
from test_watch import _watch

from rtrain.supervisor.commands.status import render_text, summarize, to_json
from rtrain.supervisor.config import SlurmConfig
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.observation import Heartbeats, Observation
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.supervisor.proc.slurm import JobTimes, parse_job_times
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.timelimit import planner
from rtrain.supervisor.timelimit.decide import Margin, Observed, learn_margin, measured, plan_stop
from rtrain.supervisor.timelimit.planner import WallClock, observed_in

# `scontrol show job --oneliner` of a job submitted with --time=2 on the one-node test cluster
# (Slurm 22.05; with or without --signal, it prints the same fields).
SHOWN = (
    "JobId=24 JobName=j.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901736 "
    "Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 "
    "Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=00:02:00 "
    "TimeMin=N/A SubmitTime=2026-11-30T21:44:58 EligibleTime=2026-11-30T21:44:58 "
    "AccrueTime=2026-11-30T21:44:58 StartTime=2026-11-30T21:44:58 EndTime=2026-11-30T21:46:58 "
    "Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-30T21:44:58 "
    "Scheduler=Main Partition=debug AllocNode:Sid=localhost:17174 ReqNodeList=(null) "
    "ExcNodeList=(null) NodeList=vm BatchHost=vm NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=21695M,node=1,billing=1 Socks/Node=* "
    "NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 "
    "Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) "
    "Network=(null) Command=/home/u/j.sh WorkDir=/home/u StdErr=/home/u/slurm-24.out "
    "StdIn=/dev/null StdOut=/home/u/slurm-24.out Power= \n")
# A pending job (requeued, or waiting for resources): no start or end yet.
PENDING = ("JobId=31 JobName=j.sh JobState=PENDING Reason=BeginTime TimeLimit=00:01:00 "
           "StartTime=Unknown EndTime=Unknown Deadline=N/A\n")


@pytest.fixture
def utc(monkeypatch):
    """Slurm prints local time without a zone: read it in a known zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_scontrol_times_are_the_jobs_real_start_and_end(utc):
    times = parse_job_times(SHOWN)
    assert times == JobTimes(start=calendar.timegm((2026, 11, 30, 21, 44, 58)),
                             end=calendar.timegm((2026, 11, 30, 21, 46, 58)))
    assert times.end - times.start == 120  # TimeLimit=00:02:00


def test_scontrol_times_read_in_the_local_zone(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")  # UTC+1 in November
    time.tzset()
    try:
        times = parse_job_times(SHOWN)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert times.end == calendar.timegm((2026, 11, 30, 20, 46, 58))


def test_unknown_times_and_no_job():
    assert parse_job_times(PENDING) == JobTimes(start=None, end=None)
    assert parse_job_times("slurm_load_jobs error: Invalid job id specified\n") is None
    assert parse_job_times("") is None


def test_job_times_outside_slurm_and_from_the_environment(tmp_path, monkeypatch):
    assert slurm.job_times({}) == (None, "not running under Slurm")
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: newer Slurm's variables answer
    times, source = slurm.job_times({"SLURM_JOB_ID": "7", "SLURM_JOB_START_TIME": "1000",
                                     "SLURM_JOB_END_TIME": "4600"})
    assert times == JobTimes(start=1000.0, end=4600.0) and "SLURM_JOB_END_TIME" in source
    times, source = slurm.job_times({"SLURM_JOB_ID": "7"})
    assert times is None and source == "scontrol not found on PATH"


@pytest.mark.parametrize(("observed", "margin", "why"), [
    ([], 60.0, "no stop or save measured yet"),
    ([Observed(stop_s=5.0)], 60.0, "the floor 60 s"),  # 2 x 5 s is under the floor
    ([Observed(stop_s=40.0), Observed(stop_s=10.0)], 80.0, "a stop took 40.0 s"),
    # a save of 35 s after a step of 5 s needs 40 s: the stop waits for the step boundary
    ([Observed(save_s=35.0, step_s=5.0), Observed(stop_s=30.0)], 80.0, "a save took 35.0 s"),
    ([Observed(save_s=45.0)], 90.0, "a save took 45.0 s after a step of 0.0 s"),
])
def test_margin_is_factor_times_the_longest_need_at_least_the_floor(observed, margin, why):
    m = learn_margin(observed, floor_s=60.0, factor=2.0)
    assert m.seconds == margin and why in m.why


NOW = 1_000_000.0
FLOOR = Margin(60.0, "the floor")


@pytest.mark.parametrize(("end", "start", "now", "stop_at", "why"), [
    (NOW + 3600, NOW - 100, NOW, NOW + 3540, "60 s before the time limit"),
    # timed from the job's real start: setup that ran before rtrain does not move the end
    (NOW + 3600, NOW - 1800, NOW, NOW + 3540, "60 s before the time limit"),
    # already due (a relaunch late in the job): at once, the child saves at its next step
    (NOW + 30, NOW - 3600, NOW, NOW, "60 s before the time limit"),
    (None, NOW, NOW, None, "no time limit"),
    # a two-minute job with a one-minute margin would be requeued forever
    (NOW + 110, NOW - 10, NOW, None, "not more than twice the margin"),
])
def test_plan_stops_margin_before_the_schedulers_end(end, start, now, stop_at, why):
    plan = plan_stop(end=end, job_start=start, now=now, margin=FLOOR)
    assert plan.stop_at == stop_at and plan.end == end and why in plan.why


def _seen(*, stop_requested=None, stop_s=None, save_s=None, step_s=None) -> Observation:
    hs = Heartbeats(max_step_interval=step_s, longest_save_s=save_s)
    return Observation(returncode=75, stop_requested=stop_requested, heartbeats=hs,
                       stop_s=stop_s)


def test_what_an_attempt_measured_goes_into_its_exit_event():
    assert measured(_seen(stop_requested="SIGUSR1", stop_s=1.23456, save_s=0.5,
                          step_s=0.1)) == {"stop_s": 1.235, "save_s": 0.5, "step_s": 0.1}
    # a hung child's kill is no measure of a save
    assert measured(_seen(stop_s=15.0)) == {}


def test_longest_save_from_the_workers_heartbeats():
    hs = Heartbeats()
    for event, t, rank in [("save_begin", 10.0, 0), ("save_begin", 10.5, 1), ("save_end", 12.0, 0),
                           ("save_end", 16.5, 1), ("save_end", 20.0, 0),  # an end without begin
                           ("save_begin", 30.0, 0)]:  # never ended: not counted
        hs = hs.add(Heartbeat(pid=1, rank=rank, time=t, event=event))
    assert hs.longest_save_s == 6.0


def test_margin_learned_from_earlier_runs_of_the_job(tmp_path):
    events = [{"kind": "exit", "stop_s": 50.0}, {"kind": "exit"},
              {"kind": "exit", "save_s": 20.0, "step_s": True}, {"kind": "launch", "stop_s": 99}]
    assert observed_in(events) == [Observed(stop_s=50.0), Observed(save_s=20.0)]
    clock = WallClock(SlurmConfig(), tmp_path / "events.jsonl",
                      job_times=lambda: (JobTimes(start=NOW - 60, end=NOW + 7200), "scontrol"))
    clock.observed = observed_in(events)
    plan = clock.plan(NOW)
    assert plan.margin_s == 100.0 and plan.stop_at == NOW + 7100
    clock.note({"stop_s": 70.0})
    assert clock.plan(NOW).margin_s == 140.0
    assert WallClock(SlurmConfig(stop_before_limit=False), tmp_path / "e",
                     job_times=lambda: pytest.fail("not asked")).plan(NOW) is None
    unknown = WallClock(SlurmConfig(), tmp_path / "e", job_times=lambda: (None, "scontrol: x"))
    plan = unknown.plan(NOW)
    assert plan.stop_at is None and "unknown" in plan.why


def test_a_time_limit_stop_is_recorded_and_requeues(tmp_path, monkeypatch):
    """The loop arms the watch at EndTime - margin; a stop there is a preemption: requeue."""
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    script = Script(outcomes=[Observation(returncode=75, stop_requested=planner.WHY,
                                          last_step=9)])
    end = script.now + 3600  # the scripted clock's start (wall and monotonic alike)
    monkeypatch.setattr(slurm, "job_times",
                        lambda: (JobTimes(start=script.now - 600, end=end), "scontrol"))
    monkeypatch.setattr(slurm, "requeue", lambda: (True, "requeued Slurm job 77"))
    armed = []
    watch = script.watch

    def watching(child, config, **kw):
        armed.append((kw["stop_at"], kw["stop_why"]))
        return watch(child, config, **kw)

    script.watch = watching
    code, events = run(tmp_path, script, requeue=True)
    assert code == 75
    assert armed == [(end - 60.0, planner.WHY)]
    kinds = [e["kind"] for e in events]
    assert kinds[:6] == ["launch", "wall_clock_stop", "exit", "classification", "decision",
                         "requeue"]
    launch, stop = events[0], events[1]
    assert launch["slurm"] | {} == {"job_id": "77", "restart_count": 0, "array": None,
                                    "end_time": end, "stop_at": end - 60.0, "margin_s": 60.0}
    assert stop["stop_at"] == end - 60.0 and stop["margin_s"] == 60.0
    assert events[3]["failure"] == "preempted" and "the job's time limit" in events[3]["reason"]
    assert events[4]["action"] == "requeue"


@pytest.mark.slow
def test_watch_stops_the_child_at_the_deadline_as_on_a_signal(tmp_path):
    with HeartbeatReceiver() as receiver:
        t0 = time.monotonic()
        outcome, _ = _watch(tmp_path, "runtime_heartbeats.py", "preempt", heartbeats=receiver,
                            stop_at=t0 + 1.0, stop_why=planner.WHY)
    seen = outcome.seen
    ev = seen
    assert ev.returncode == 75 and ev.stop_requested == planner.WHY
    assert seen.signals == () and outcome.stop.signal_sent == "SIGTERM"
    assert not ev.killed_after_grace and seen.heartbeats.last_event == "stop"
    assert seen.stop_s is not None and 0 <= seen.stop_s < 5
    assert time.monotonic() - t0 >= 1.0


def test_status_shows_the_time_limit_and_the_planned_stop(tmp_path, utc):
    run_dir = tmp_path / "run"
    end = calendar.timegm((2026, 11, 30, 22, 0, 0))
    job = {"job_id": "77", "restart_count": 1, "array": None, "end_time": end,
           "stop_at": end - 90.0, "margin_s": 90.0}
    with EventLog(run_dir / "events.jsonl", clock=lambda: end - 600) as log:
        log.emit("launch", attempt=0, argv=["python", "train.py"], settings={}, level=0,
                 resume_from=None, pid=100, ckpt_dir=str(run_dir / "checkpoints"), slurm=job)
    s = summarize(run_dir, now=end - 500)
    assert s.slurm == {k: job[k] for k in ("job_id", "restart_count", "end_time", "stop_at",
                                           "margin_s")}
    row = next(ln for ln in render_text(s).splitlines() if ln.strip().startswith("slurm"))
    assert row.endswith("job 77 (requeued 1 times); time limit at 2026-11-30 22:00:00, saving "
                        "and stopping at 2026-11-30 21:58:30 (90 s before)")
    assert to_json(s)["slurm"]["stop_at"] == end - 90.0
