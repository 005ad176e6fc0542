"""Judge one ended attempt: `judge(result, history, config) -> Judgement`, a pure function.

The loop hands in an `AttemptResult`: what the watch saw (decide/observation.py) and what only
I/O can learn (the newest verified step, whether the attempt committed a checkpoint, the Slurm
job, the time, a random number for the jitter). `judge` classifies the
failure (classify.py), stops offering a checkpoint the worker could not load, counts the
attempt's progress and decides (policy.py), and returns the decision with what to record, in
the order a reader of events.jsonl expects:

    wall_clock_stop? signal* exit heartbeat_summary? stuck_ranks? device_failed?
    classification?
    skipped_checkpoint? failure_rate? quarantine? decision degrade?

Each record is an `Event` for events.jsonl or a `Say`, a line for the terminal; the loop writes
them in this order, then acts on the decision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import PurePath
from typing import Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.history import History
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.decide.policy import Decision, decide, note_progress
from rtrain.supervisor.decide.streak import Resumed
from rtrain.supervisor.timelimit.decide import WHY, WallPlan, measured


@dataclass(frozen=True, kw_only=True)
class AttemptResult:
    """How one attempt ended, and what judging it needs that only I/O can learn: the loop
    gathers all of it before the call."""

    seen: Observation
    duration_s: float  # the attempt's run as the loop timed it (the exit event's)
    resumed: Resumed | None = None  # the checkpoint it resumed from
    # that checkpoint as `History.bad_checkpoints` names it (ckpt/foreign.py resume_identity)
    resumed_identity: str | None = None
    committed: bool = False  # it committed a checkpoint newer than `resumed`
    progressed: bool = False  # new verified content in a foreign checkpoint (ckpt/progress.py)
    newest_step: int | None = None  # the newest verified checkpoint's step, after the attempt
    now: float = 0.0  # unix time: the failure-rate window's
    rand: float = 0.0  # in [0, 1): the backoff's jitter
    slurm: dict[str, Any] | None = None  # the Slurm job we run in (proc/slurm.py job_info)
    wall: WallPlan | None = None  # the attempt's planned stop before the job's time limit


@dataclass(frozen=True)
class Event:
    """An event for events.jsonl: its kind and its fields."""

    kind: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class Say:
    """A line for the terminal."""

    line: str


Record = Event | Say


class Records:
    """What to record, collected in order: `emit` and `say` take what `EventLog.emit` and the
    terminal's `say` take (tests/test_event_schema.py checks the kinds and fields named here)."""

    def __init__(self) -> None:
        self.items: list[Record] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.items.append(Event(kind, fields))

    def say(self, line: str) -> None:
        self.items.append(Say(line))


@dataclass(frozen=True, kw_only=True)
class Judgement:
    """What `judge` returns: the decision, the failure it rests on and what to record."""

    decision: Decision  # its history is the one to persist
    failure: Failure | None  # None: the child exited 0
    records: tuple[Record, ...]  # to write, in order, before acting on the decision


def judge(result: AttemptResult, history: History, config: Config) -> Judgement:
    """The decision on the attempt `history.attempt`, and what to record of its end."""
    attempt, seen, out = history.attempt, result.seen, Records()
    record_wall_clock_stop(out, attempt, result.wall, seen)
    record_end(out, attempt, seen, result.duration_s, result.slurm)
    failure = None
    if not (seen.exit_code == 0 and not seen.signal):
        failure = classify(seen, memory_pressure_fraction=config.memory_pressure_fraction)
        record_failure(out, attempt, failure)
        if failure.kind is FailureKind.BAD_CHECKPOINT:
            history = _skip_bad(out, history, result, failure.reason)
    resumed = result.resumed
    history = note_progress(history, seen, resumed_step=resumed and resumed.step,
                            duration_s=result.duration_s)
    decision = decide(failure, history, config, rand=result.rand,
                      newest_step=result.newest_step, now=result.now, resumed=resumed,
                      committed=result.committed or result.progressed,
                      on_slurm=result.slurm is not None, progressed=result.progressed)
    record_decision(out, attempt, decision, config)
    return Judgement(decision=decision, failure=failure, records=tuple(out.items))


def _skip_bad(out: Records, history: History, result: AttemptResult, reason: str) -> History:
    """The worker could not load the checkpoint it resumed from: never offer it again."""
    if result.resumed is None or result.resumed_identity is None:
        return history
    path = result.resumed.path
    out.say(f"skipping {PurePath(path).name} from now on: {reason}")
    out.emit("skipped_checkpoint", path=path, reason=f"cannot load: {reason}")
    return replace(history, bad_checkpoints=(*history.bad_checkpoints, result.resumed_identity))


def record_wall_clock_stop(out: Records, attempt: int, plan: WallPlan | None,
                           seen: Observation) -> None:
    """The attempt was stopped before the job's time limit (not by a signal that came first)."""
    if plan is None or plan.stop_at is None or seen.stop_requested != WHY:
        return
    out.emit("wall_clock_stop", attempt=attempt, end_time=plan.end, stop_at=plan.stop_at,
             margin_s=round(plan.margin_s, 3), reason=plan.why)
    out.say(f"attempt {attempt}: stopped {plan.why}")


def record_end(out: Records, attempt: int, seen: Observation, duration_s: float,
               slurm: dict[str, Any] | None) -> None:
    """The signals that reached rtrain, the exit, the last heartbeat's figures and the devices
    that failed their health checks."""
    hs = seen.heartbeats
    for name in seen.signals:
        out.emit("signal", name=name)
    out.emit("exit", attempt=attempt, returncode=seen.exit_code, signal=seen.signal,
             duration_s=round(duration_s, 3), last_step=seen.last_step,
             peak_rss_bytes=seen.peak_rss_bytes, gpu_used_peak=seen.gpu_mem_used_peak,
             gpu_total=seen.gpu_mem_total, leftovers=list(seen.leftovers),
             **measured(seen), **_ending_times(seen))
    if hs.last_step is not None:
        out.emit("heartbeat_summary", attempt=attempt, step=hs.last_step, loss=hs.last_loss,
                 samples_per_s=hs.samples_per_s, rss_bytes=seen.peak_rss_bytes,
                 gpu_used=seen.gpu_mem_used_peak, gpu_total=seen.gpu_mem_total)
    if seen.stuck or seen.flight_dumps:
        stuck = seen.stuck or {}
        out.emit("stuck_ranks", attempt=attempt, summary=stuck.get("summary", ""),
                 behind=stuck.get("behind", []), ranks=stuck.get("ranks", []),
                 flight_recorder=list(seen.flight_dumps))
    if seen.failed_devices:
        out.emit("device_failed", attempt=attempt, detail=seen.failed_detail,
                 devices=list(seen.failed_devices), **({"slurm": slurm} if slurm else {}))


def _ending_times(seen: Observation) -> dict[str, float]:
    """When the attempt ended, for the cost of a failure (records/recovery.py): the exit seen,
    the hang declared, and the failure as a rank reported it by its own clock (the first exit
    record or `exception` heartbeat)."""
    reports = [r.get("time") for r in seen.exit_records] + [seen.heartbeats.exception_at]
    times = {"exited_at": seen.exited_at, "hang_at": seen.hang_at,
             "reported_at": min((t for t in reports if isinstance(t, (int, float))),
                                default=None)}
    return {k: round(v, 6) for k, v in times.items() if v is not None}


def group_broke_at(seen: Observation) -> float | None:
    """When this node's group broke, as this node saw it (unix time): the first `exception` its
    ranks reported, where that was a collective broken by a rank gone (the group broke
    elsewhere, then); else its exit (its ranks' end is what broke the other nodes'
    collectives: a rank that raised on its own, a signal, a hang stopped)."""
    hb = seen.heartbeats
    if hb.exception_peer_lost and hb.exception_at is not None:
        return hb.exception_at
    return seen.exited_at


def record_failure(out: Records, attempt: int, failure: Failure) -> None:
    """What the attempt failed of, in a word and in the sentence a person reads."""
    out.emit("classification", attempt=attempt, failure=failure.kind.value,
             reason=failure.reason)
    out.say(f"attempt {attempt} failed: {failure.kind.value}: {failure.reason}")


def record_decision(out: Records, attempt: int, decision: Decision, config: Config) -> None:
    """The decision, with the alarm, the quarantine and the rung change it carries."""
    if decision.alarm:
        # Progress forgives failures, so a run can fail all day without stopping: say so.
        out.emit("failure_rate", attempt=attempt, detail=decision.alarm,
                 count=len(decision.history.failure_times),
                 limit=config.restart.max_failures_per_hour)
        out.say(f"WARNING: {decision.alarm}")
    if decision.quarantine:
        q = decision.quarantine
        out.emit("quarantine", attempt=attempt, path=q["path"], step=q["step"],
                 reason=q["reason"])
        out.say(f"quarantined {q['path']}: {q['reason']}")
    out.emit("decision", attempt=attempt, action=decision.action.value, reason=decision.reason,
             backoff_s=round(decision.backoff_s, 3), level=decision.level,
             settings=decision.settings, exit_code=decision.exit_code,
             resume=decision.resume.value)
    if decision.ladder_change:
        out.emit("degrade", attempt=attempt, change=decision.ladder_change,
                 level=decision.level, settings=decision.settings)
        out.say(f"degrading: {decision.ladder_change} -> settings "
                f"{json.dumps(decision.settings)}")
