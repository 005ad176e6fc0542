"""Writing what `decide.attempt.judge` says to record of an attempt's end and its decision, in
its order: each `Event` to events.jsonl, each `Say` to the terminal. And the `slurm` field of the
events that carry one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rtrain.supervisor.decide.attempt import Event, Record
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.timelimit.decide import WallPlan


def record(records: Iterable[Record], events: EventLog, say: Callable[[str], None]) -> None:
    for r in records:
        if isinstance(r, Event):
            events.emit(r.kind, **r.fields)
        else:
            say(r.line)


def slurm_field(plan: WallPlan | None = None) -> dict[str, Any]:
    """The `slurm` field of an event under Slurm; with the attempt's plan (the launch event),
    also the job's end, the planned stop (null: not armed) and the margin."""
    info = slurm.job_info()
    if info and plan is not None:
        info |= {"end_time": plan.end, "stop_at": plan.stop_at,
                 "margin_s": round(plan.margin_s, 3)}
    return {"slurm": info} if info else {}
