"""The events (and terminal lines) that record how an attempt ended and what was decided, in the
order a reader of events.jsonl expects them:

    wall_clock_stop? signal* exit heartbeat_summary? device_failed? classification?
    skipped_checkpoint? failure_rate? quarantine? decision degrade?
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from supervisor.config import Config
from supervisor.decide.failures import Failure
from supervisor.decide.policy import Decision
from supervisor.decide.wall_clock import WallPlan
from supervisor.launch import wallclock
from supervisor.proc import slurm
from supervisor.proc.gpu_health import describe
from supervisor.proc.watch_outcome import Outcome
from supervisor.records.events import EventLog


def slurm_field(plan: WallPlan | None = None) -> dict[str, Any]:
    """The `slurm` field of an event under Slurm; with the attempt's plan (the launch event),
    also the job's end, the planned stop (null: not armed) and the margin."""
    info = slurm.job_info()
    if info and plan is not None:
        info |= {"end_time": plan.end, "stop_at": plan.stop_at,
                 "margin_s": round(plan.margin_s, 3)}
    return {"slurm": info} if info else {}


def record_wall_clock_stop(events: EventLog, say: Callable[[str], None], attempt: int,
                           plan: WallPlan | None, outcome: Outcome) -> None:
    """The attempt was stopped before the job's time limit (not by a signal that came first)."""
    if plan is None or plan.stop_at is None or outcome.evidence.stop_requested != wallclock.WHY:
        return
    events.emit("wall_clock_stop", attempt=attempt, end_time=plan.end, stop_at=plan.stop_at,
                margin_s=round(plan.margin_s, 3), reason=plan.why)
    say(f"attempt {attempt}: stopped {plan.why}")


def record_exit(events: EventLog, attempt: int, outcome: Outcome, duration_s: float) -> None:
    ev, hs = outcome.evidence, outcome.heartbeats
    for name in outcome.signals:
        events.emit("signal", name=name)
    events.emit("exit", attempt=attempt, returncode=ev.returncode, signal=ev.signal,
                duration_s=round(duration_s, 3), last_step=ev.last_step,
                peak_rss_bytes=ev.peak_rss_bytes, gpu_used_peak=ev.gpu_mem_used_peak,
                gpu_total=ev.gpu_mem_total, leftovers=outcome.stop.leftovers,
                **wallclock.measured(outcome), **_ending_times(outcome))
    if hs.last_step is not None:
        events.emit("heartbeat_summary", attempt=attempt, step=hs.last_step,
                    loss=hs.last_loss, samples_per_s=hs.samples_per_s,
                    rss_bytes=ev.peak_rss_bytes, gpu_used=ev.gpu_mem_used_peak,
                    gpu_total=ev.gpu_mem_total)
    if outcome.failed_devices:
        failed = list(outcome.failed_devices)
        events.emit("device_failed", attempt=attempt, detail=describe(failed),
                    devices=[h.to_dict() for h in failed], **slurm_field())


def _ending_times(outcome: Outcome) -> dict[str, float]:
    """When the attempt ended, for the cost of a failure (records/recovery.py): the exit seen,
    the hang declared, and the failure as a rank reported it by its own clock (the first exit
    record or `exception` heartbeat)."""
    ev = outcome.evidence
    reports = [r.get("time") for r in ev.exit_records] + [outcome.heartbeats.exception_at]
    times = {"exited_at": outcome.exited_at, "hang_at": ev.hang_at,
             "reported_at": min((t for t in reports if isinstance(t, (int, float))),
                                default=None)}
    return {k: round(v, 6) for k, v in times.items() if v is not None}


def record_failure(events: EventLog, say: Callable[[str], None], attempt: int,
                   failure: Failure) -> None:
    events.emit("classification", attempt=attempt, failure=failure.kind.value,
                reason=failure.reason)
    say(f"attempt {attempt} failed: {failure.kind.value}: {failure.reason}")


def record_decision(events: EventLog, say: Callable[[str], None], attempt: int,
                    decision: Decision, config: Config) -> None:
    if decision.alarm:
        # Progress forgives failures, so a run can fail all day without stopping: say so.
        events.emit("failure_rate", attempt=attempt, detail=decision.alarm,
                    count=len(decision.history.failure_times),
                    limit=config.restart.max_failures_per_hour)
        say(f"WARNING: {decision.alarm}")
    if decision.quarantine:
        q = decision.quarantine
        events.emit("quarantine", attempt=attempt, path=q["path"], step=q["step"],
                    reason=q["reason"])
        say(f"quarantined {q['path']}: {q['reason']}")
    events.emit("decision", attempt=attempt, action=decision.action.value,
                reason=decision.reason, backoff_s=round(decision.backoff_s, 3),
                level=decision.level, settings=decision.settings,
                exit_code=decision.exit_code, resume=decision.resume.value)
    if decision.ladder_change:
        events.emit("degrade", attempt=attempt, change=decision.ladder_change,
                    level=decision.level, settings=decision.settings)
        say(f"degrading: {decision.ladder_change} -> settings "
            f"{json.dumps(decision.settings)}")
