"""judge(): one ended attempt in, the decision and what to record out, by table; and the
what classify reads of what the watch saw. Pure: no process, clock or file."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest

from rtrain.supervisor.config import Config
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.attempt import AttemptResult, Event, Say, judge
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.decide.history import History
from rtrain.supervisor.decide.observation import Heartbeats, Observation
from rtrain.supervisor.decide.policy import Action
from rtrain.supervisor.decide.streak import Resumed
from rtrain.supervisor.timelimit.decide import WHY, WallPlan

K = FailureKind
PID = 4_200_000
SETTINGS = {"batch_size": 16, "grad_accum": 1}
BAD = {"kind": "bad_checkpoint", "rank": 0, "time": 5.0,
       "reason": "checkpoint-8: cannot load: model.safetensors: content hash does not match"}
CKPT_8 = Resumed(path="/ckpt/checkpoint-8", id="c8", step=8)


def seen(**kw) -> Observation:
    return Observation(pid=PID, **kw)


def shape(records) -> list[str]:
    """Each record as its event kind, or "say" for a terminal line."""
    return [r.kind if isinstance(r, Event) else "say" for r in records]


def event(records, kind: str) -> dict:
    [found] = [r.fields for r in records if isinstance(r, Event) and r.kind == kind]
    return found


def lines(records) -> list[str]:
    return [r.line for r in records if isinstance(r, Say)]


CASES = {
    "crash": (
        AttemptResult(seen=seen(returncode=1, stderr_tail="ValueError: bad batch\n", last_step=5),
                      duration_s=30.0, newest_step=None),
        K.CRASH, Action.RELAUNCH,
        ["exit", "classification", "say", "decision"]),
    "oom, one rung down": (
        AttemptResult(seen=seen(returncode=1, last_step=7,
                                stderr_tail="torch.OutOfMemoryError: CUDA out of memory\n"),
                      duration_s=30.0),
        K.OOM_GPU, Action.RELAUNCH,
        ["exit", "classification", "say", "decision", "degrade", "say"]),
    "bad checkpoint": (
        AttemptResult(seen=seen(returncode=65, exit_records=(BAD,)), duration_s=2.0,
                      resumed=CKPT_8, resumed_identity="/ckpt/checkpoint-8|123", newest_step=8),
        K.BAD_CHECKPOINT, Action.RELAUNCH,
        ["exit", "classification", "say", "say", "skipped_checkpoint", "decision"]),
    "preempted, stop confirmed": (
        AttemptResult(seen=seen(returncode=75, stop_requested="SIGUSR1", signals=("SIGUSR1",),
                                last_step=140, stop_s=3.0,
                                heartbeats=Heartbeats(count=9, last_event="stop",
                                                      last_step=140, last_loss=0.5)),
                      duration_s=600.0, resumed=CKPT_8, newest_step=140, committed=True),
        K.PREEMPTED, Action.EXIT_PREEMPTED,
        ["signal", "exit", "heartbeat_summary", "classification", "say", "decision"]),
    "hang of a torchrun group, the stuck rank named": (
        AttemptResult(seen=seen(returncode=-9, hang=True, hang_detail="no heartbeat",
                                stuck={"summary": "rank 3 is in step 5", "behind": [3],
                                       "ranks": [{"rank": 3}]},
                                flight_dumps=("/run/attempts/0/nccl_trace_rank_3",)),
                      duration_s=60.0),
        K.HANG, Action.RELAUNCH,
        ["exit", "stuck_ranks", "classification", "say", "decision"]),
    "finished": (
        AttemptResult(seen=seen(returncode=0, last_step=10), duration_s=30.0, newest_step=10),
        None, Action.FINISHED,
        ["exit", "decision"]),
    "startup failure": (
        AttemptResult(seen=seen(returncode=1, duration_s=1.5,
                                stderr_tail="ModuleNotFoundError: No module named 'tarin'\n"),
                      duration_s=1.5),
        K.STARTUP, Action.GIVE_UP,
        ["exit", "classification", "say", "decision"]),
}


@pytest.mark.parametrize(("result", "kind", "action", "records"), CASES.values(),
                         ids=CASES.keys())
def test_judge_by_table(result, kind, action, records):
    j = judge(result, History(attempt=3), Config(settings=dict(SETTINGS)))
    assert (j.failure.kind if j.failure else None) is kind
    assert j.decision.action is action
    assert shape(j.records) == records
    # The records name the attempt judged (all but the signal and the skipped checkpoint).
    assert all(r.fields["attempt"] == 3 for r in j.records
               if isinstance(r, Event) and r.kind not in ("signal", "skipped_checkpoint"))
    exit_ = event(j.records, "exit")
    assert exit_["duration_s"] == result.duration_s
    assert exit_["last_step"] == result.seen.last_step
    decision = event(j.records, "decision")
    assert (decision["action"], decision["reason"]) == (action.value, j.decision.reason)


def test_a_hang_records_the_stuck_rank_and_the_flight_recorder_dumps():
    result, *_ = CASES["hang of a torchrun group, the stuck rank named"]
    j = judge(result, History(), Config())
    stuck = event(j.records, "stuck_ranks")
    assert stuck["summary"] == "rank 3 is in step 5" and stuck["behind"] == [3]
    assert stuck["flight_recorder"] == ["/run/attempts/0/nccl_trace_rank_3"]
    assert event(j.records, "classification")["reason"].endswith("; rank 3 is in step 5")


def test_heartbeats_keep_each_ranks_pid_and_last_step():
    hbs = Heartbeats()
    for hb in (Heartbeat(pid=11, rank=0, time=1.0, event="start", world=2),
               Heartbeat(pid=12, rank=1, time=1.0, step=4, world=2),
               Heartbeat(pid=11, rank=0, time=2.0, step=5),
               Heartbeat(pid=12, rank=1, time=2.0, event="save_begin", step=5)):
        hbs = hbs.add(hb)
    assert hbs.ranks == {0: (11, 5), 1: (12, 4)} and hbs.world == 2


def test_a_crash_is_recorded_with_its_reason_and_relaunched_after_a_backoff():
    result, *_ = CASES["crash"]
    j = judge(result, History(), Config(settings=dict(SETTINGS)))
    cls = event(j.records, "classification")
    assert cls == {"attempt": 0, "failure": "crash", "reason": j.failure.reason}
    assert f"PID {PID} exited with code 1 at step 5" in j.failure.reason
    assert lines(j.records) == [f"attempt 0 failed: crash: {j.failure.reason}"]
    assert j.decision.backoff_s > 0 and j.decision.history.budgets_used == {"crash": 1}


def test_an_oom_steps_down_the_ladder_and_records_the_rung():
    result, *_ = CASES["oom, one rung down"]
    j = judge(result, History(), Config(settings=dict(SETTINGS)))
    assert j.decision.settings == {"batch_size": 8, "grad_accum": 2} and j.decision.level == 1
    degrade = event(j.records, "degrade")
    assert degrade["level"] == 1 and degrade["settings"] == j.decision.settings
    assert lines(j.records)[-1] == (f"degrading: {j.decision.ladder_change} -> settings "
                                    '{"batch_size": 8, "grad_accum": 2}')
    assert j.decision.history.budgets_used == {"oom": 1}


def test_a_checkpoint_the_worker_could_not_load_is_never_offered_again():
    result, *_ = CASES["bad checkpoint"]
    j = judge(result, History(), Config(settings=dict(SETTINGS)))
    assert j.decision.history.bad_checkpoints == ("/ckpt/checkpoint-8|123",)
    assert event(j.records, "skipped_checkpoint") == {
        "path": "/ckpt/checkpoint-8", "reason": f"cannot load: {j.failure.reason}"}
    assert lines(j.records)[1] == f"skipping checkpoint-8 from now on: {j.failure.reason}"
    assert j.decision.backoff_s == 0.0
    # The attempt ended before its first step: a fresh start has nothing to skip.
    fresh = judge(replace(result, resumed=None, resumed_identity=None), History(),
                  Config(settings=dict(SETTINGS)))
    assert "skipped_checkpoint" not in shape(fresh.records)
    assert fresh.decision.history.bad_checkpoints == ()


def test_a_confirmed_stop_exits_75_and_records_the_heartbeats():
    result, *_ = CASES["preempted, stop confirmed"]
    j = judge(result, History(attempt=3), Config(settings=dict(SETTINGS)))
    assert "after committing a checkpoint" in j.failure.reason
    assert (j.decision.exit_code, j.decision.history.attempt) == (75, 4)
    assert event(j.records, "signal") == {"name": "SIGUSR1"}
    assert event(j.records, "exit")["stop_s"] == 3.0
    assert event(j.records, "heartbeat_summary") == {
        "attempt": 3, "step": 140, "loss": 0.5, "samples_per_s": None, "rss_bytes": 0,
        "gpu_used": None, "gpu_total": None}
    requeued = judge(result, History(attempt=3), Config(settings=dict(SETTINGS), requeue=True))
    assert requeued.decision.action is Action.REQUEUE


def test_a_finished_run_records_no_failure():
    result, *_ = CASES["finished"]
    j = judge(result, History(), Config(settings=dict(SETTINGS)))
    assert j.decision.exit_code == 0 and lines(j.records) == []
    assert j.decision.history.healthy_steps == 10


def test_a_script_that_fails_at_start_up_is_not_retried():
    result, *_ = CASES["startup failure"]
    j = judge(result, History(), Config(settings=dict(SETTINGS)))
    assert j.decision.exit_code == 3 and "not retrying" in j.decision.reason
    assert "ModuleNotFoundError" in j.failure.reason


def test_the_stop_before_the_time_limit_and_a_failed_device_are_recorded_first():
    plan = WallPlan(end=2000.0, stop_at=1940.0, margin_s=60.0, why="60 s before the limit")
    failed = {"index": 0, "reachable": False, "error": "gone"}
    stopped = AttemptResult(
        seen=seen(returncode=75, stop_requested=WHY, failed_devices=(failed,),
                  failed_detail="GPU 0: unreachable (gone)"),
        duration_s=100.0, wall=plan, slurm={"job_id": "77", "restart_count": 0, "array": None})
    j = judge(stopped, History(), Config())
    assert shape(j.records)[:4] == ["wall_clock_stop", "say", "exit", "device_failed"]
    assert event(j.records, "wall_clock_stop") == {
        "attempt": 0, "end_time": 2000.0, "stop_at": 1940.0, "margin_s": 60.0,
        "reason": "60 s before the limit"}
    assert event(j.records, "device_failed") == {
        "attempt": 0, "detail": "GPU 0: unreachable (gone)", "devices": [failed],
        "slurm": {"job_id": "77", "restart_count": 0, "array": None}}
    # A signal that came first names the stop: no wall-clock record.
    by_signal = replace(stopped, seen=replace(stopped.seen, stop_requested="SIGTERM"))
    assert "wall_clock_stop" not in shape(judge(by_signal, History(), Config()).records)


def test_judging_is_pure():
    result, *_ = CASES["oom, one rung down"]
    history, config = History(attempt=2), Config(settings=dict(SETTINGS))
    first = judge(result, history, config)
    assert judge(result, history, config) == first
    assert history == History(attempt=2) and config.settings == SETTINGS
    with pytest.raises(FrozenInstanceError):
        result.seen.returncode = 0  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        first.failure.seen.last_step = 0  # type: ignore[misc,union-attr]


# ------------------------------------------------------------------ what classify reads

@pytest.mark.parametrize(("observed", "expected"), [
    # a signal: the name, no exit code
    (Observation(returncode=-9), {"exit_code": None, "signal": "SIGKILL"}),
    (Observation(returncode=3), {"exit_code": 3, "signal": None}),
    # a step heartbeat: past start-up, whatever stderr says
    (Observation(returncode=1, last_step=0, stderr_tail="ImportError: x"),
     {"first_step_seen": True, "last_step": 0}),
    # no heartbeats at all (a plain script): past start-up unless it died early of a start-up
    # error
    (Observation(returncode=1, duration_s=5.0, stderr_tail="ImportError: x"),
     {"first_step_seen": False}),
    (Observation(returncode=1, duration_s=500.0, stderr_tail="ImportError: x"),
     {"first_step_seen": True}),
    (Observation(returncode=1, duration_s=5.0, stderr_tail="ValueError: x"),
     {"first_step_seen": True}),
    # heartbeats, but none with a step: it died before its first step
    (Observation(returncode=1, heartbeats=Heartbeats(count=2, last_event="start")),
     {"first_step_seen": False}),
    # the workers confirmed the stop with their last heartbeat
    (Observation(returncode=75, heartbeats=Heartbeats(count=4, last_event="stop")),
     {"stop_confirmed": True}),
    (Observation(returncode=75, heartbeats=Heartbeats(count=4, last_event="step")),
     {"stop_confirmed": False}),
    # a device lost while it ran, and one that failed its health checks after
    (Observation(returncode=1, gpu_lost=True, gpu_detail="Xid 79",
                 failed_devices=({"index": 1},), failed_detail="GPU 1: retired pages"),
     {"device_lost": True, "device_detail": "Xid 79; GPU 1: retired pages"}),
    (Observation(returncode=1, failed_devices=({"index": 1},), failed_detail="GPU 1: gone"),
     {"device_lost": True, "device_detail": "GPU 1: gone"}),
    # the host limit: the cgroup's when pressure measured one, else the machine's memory
    (Observation(returncode=1, host_mem_total=64, host_mem_limit=16), {"memory_limit": 16}),
    (Observation(returncode=1, host_mem_total=64), {"memory_limit": 64}),
])
def test_what_classify_reads_of_what_the_watch_saw(observed, expected):
    assert {k: getattr(observed, k) for k in expected} == expected


def test_heartbeats_fold_without_changing_what_was_folded():
    before = Heartbeats()
    after = before.add(Heartbeat(pid=1, rank=0, time=1.0, event="step", step=3, loss=0.25))
    assert before == Heartbeats()
    assert (after.count, after.last_event, after.last_step, after.last_loss) == (1, "step", 3,
                                                                                 0.25)
