"""When to stop before the job's time limit: pure functions of the scheduler's times, the clock
passed in and what earlier stops and saves took.

A Slurm job that reaches its time limit is killed (SIGTERM, SIGKILL `KillWait` later) and is not
requeued: the steps since the last periodic save are lost and the job does not come back. With
`sbatch --signal=B:USR1@N` Slurm warns the batch shell N seconds before; without it (or with an
N too short for a save) rtrain stops the attempt itself at `end - margin`, exactly as on the
warning signal, and requeues the job.

The margin is learned (`learn_margin`): it must cover finishing the step in progress, writing the
checkpoint and exiting, which earlier attempts of the run measured: the time from a stop signal
to the child's exit, and the longest save plus the longest step. The margin is `factor` times the
longest such need, and never less than `floor_s` (also the margin before anything was measured).

The end comes from the scheduler (EndTime = the job's real start + TimeLimit), never from when
rtrain started: the batch script's setup before rtrain may have taken minutes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rtrain.supervisor.decide.observation import Observation

WHY = "the job's time limit"
"""The stop's name in the Observation (`stop_requested`) and so in the reason sentences."""


@dataclass(frozen=True)
class Observed:
    """What one earlier attempt measured (any may be None: not seen in that attempt)."""

    stop_s: float | None = None  # stop signal to the child's exit
    save_s: float | None = None  # the longest checkpoint save (save_begin to save_end)
    step_s: float | None = None  # the longest step interval


@dataclass(frozen=True)
class Margin:
    seconds: float
    why: str  # what it was learned from, for the event and the terminal


def learn_margin(observed: Iterable[Observed], *, floor_s: float, factor: float) -> Margin:
    """The time before the limit to send the stop: `factor` x the longest need measured, at
    least `floor_s`."""
    needs: list[tuple[float, str]] = []
    for o in observed:
        if o.stop_s is not None:
            needs.append((o.stop_s, f"a stop took {o.stop_s:.1f} s"))
        if o.save_s is not None:
            step = o.step_s or 0.0
            needs.append((o.save_s + step, f"a save took {o.save_s:.1f} s after a step of "
                                           f"{step:.1f} s"))
    if not needs:
        return Margin(floor_s, f"the floor {floor_s:g} s: no stop or save measured yet")
    need, what = max(needs)
    learned = factor * need
    if learned <= floor_s:
        return Margin(floor_s, f"the floor {floor_s:g} s, above {factor:g} x the longest need: "
                               f"{what}")
    return Margin(learned, f"{factor:g} x the longest need: {what}")


@dataclass(frozen=True)
class WallPlan:
    """Whether and when (unix seconds) to stop the attempt before the job's time limit."""

    stop_at: float | None  # None: not armed
    end: float | None
    margin_s: float
    why: str


def plan_stop(*, end: float | None, job_start: float | None, now: float,
              margin: Margin) -> WallPlan:
    """The stop for an attempt starting at `now` in a job that ends at `end`.

    Not armed without a time limit, nor when the margin takes half the job's time limit or more:
    stopping there would requeue a job that can barely run, over and over (better to say so and
    let Slurm end it). A stop already due arms at once: the child saves at its first step
    boundary and the job is requeued, instead of being killed at the limit and not requeued."""
    m = margin.seconds
    if end is None:
        return WallPlan(None, None, m, "the job has no time limit")
    if job_start is not None and end - job_start <= 2 * m:
        return WallPlan(None, end, m, (
            f"the job's time limit ({end - job_start:.0f} s) is not more than twice the margin "
            f"({m:.0f} s, {margin.why}): not stopping before it; give the job more time"))
    stop_at = max(end - m, now)
    return WallPlan(stop_at, end, m, f"{m:.0f} s before the time limit ({margin.why})")


def measured(seen: Observation) -> dict[str, float]:
    """The `exit` event's optional fields: what this attempt measured for the margin. The stop
    counts only when a stop signal or the deadline asked for it (a hung child is killed, not
    saved)."""
    hs = seen.heartbeats
    out = {"stop_s": seen.stop_s if seen.stop_requested else None,
           "save_s": hs.longest_save_s, "step_s": hs.max_step_interval}
    return {k: round(v, 3) for k, v in out.items() if v is not None}
