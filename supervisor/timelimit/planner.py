"""The stop before the Slurm job's time limit, for each attempt of this launch: the job's end
from the scheduler (proc/slurm.py), the margin learned from what earlier attempts of the run
measured (the `exit` events' `stop_s`, `save_s`, `step_s`, read once from events.jsonl, then
added as attempts end), the plan from timelimit/decide.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rtrain.supervisor.config import SlurmConfig
from rtrain.supervisor.core.errors import RtrainError
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.timelimit.decide import WHY as WHY
from rtrain.supervisor.timelimit.decide import Observed, WallPlan, learn_margin, plan_stop


def observed_in(events: Iterable[dict[str, Any]]) -> list[Observed]:
    """What the `exit` events of earlier attempts (earlier runs of the job too) measured."""
    found = []
    for e in events:
        if e.get("kind") != "exit":
            continue
        o = Observed(stop_s=_seconds(e.get("stop_s")), save_s=_seconds(e.get("save_s")),
                     step_s=_seconds(e.get("step_s")))
        if o != Observed():
            found.append(o)
    return found


def _seconds(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
    return float(value) if ok else None


class WallClock:
    """Plans each attempt's stop before the job's time limit; None outside Slurm."""

    def __init__(self, config: SlurmConfig, events_path: Path, *,
                 job_times: Callable[[], tuple[slurm.JobTimes | None, str]] | None = None
                 ) -> None:
        self.config, self.job_times = config, job_times or (lambda: slurm.job_times())
        try:
            self.observed = observed_in(read_events(events_path)) if events_path.exists() else []
        except (OSError, RtrainError):  # an unreadable log: learn from this launch on
            self.observed = []

    def plan(self, now: float) -> WallPlan | None:
        """The plan for an attempt starting at `now` (unix seconds); None outside Slurm or
        when `[slurm] stop_before_limit` is off."""
        if not self.config.stop_before_limit:
            return None
        times, source = self.job_times()
        if times is None:
            return None if source == "not running under Slurm" else WallPlan(
                None, None, self.config.margin_s, f"the job's end is unknown: {source}")
        margin = learn_margin(self.observed, floor_s=self.config.margin_s,
                              factor=self.config.margin_factor)
        return plan_stop(end=times.end, job_start=times.start, now=now, margin=margin)

    def note(self, fields: dict[str, float]) -> None:
        """An attempt ended having measured these (timelimit/decide.py `measured`)."""
        o = Observed(stop_s=fields.get("stop_s"), save_s=fields.get("save_s"),
                     step_s=fields.get("step_s"))
        if o != Observed():
            self.observed.append(o)
