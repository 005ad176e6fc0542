"""How often to save under `every="auto"`: a pure decision from cost and risk.

A save costs the training thread its stall C (the capture, or the whole write when saving
synchronously, plus any wait for the previous background save); a failure costs the work since
the last save. With failures arriving at a mean time between failures M, the interval between
saves that loses the least time in expectation is about sqrt(2·C·M) (Young 1974; Daly 2006
adds terms that matter only when C is a sizeable part of M, which a checkpoint stall is not).

Rules, in order:
1. M: the run's observed MTBF once it has failed (seconds its attempts ran / work-losing
   failures, never below `MIN_MTBF_S`); before any failure the prior `PRIOR_MTBF_S` (24 h: a
   single GPU node's failure rate, from published cluster studies, is of the order of a day),
   or the time run so far if that is longer (a run that went three days without failing has
   shown it fails less often than daily). The prior is not blended in once failures are seen:
   one pseudo-failure over 24 h would hide a machine that fails every ten minutes for dozens of
   failures, and the first failure is already direct evidence of this run's rate.
2. The Young/Daly interval, in steps of the measured step time.
3. The loss trend: how much the loss falls (relative) over that interval. A loss falling fast
   makes each step's progress dearer to lose, so save more often; a plateau, less often. The
   factor is sqrt(LOSS_FALL_REF / fall), bounded to [LOSS_FACTOR_MIN, LOSS_FACTOR_MAX]: 1 at a
   1 % fall per interval, 0.5 at 4 % or more, 2 at a quarter percent or less (a plateau, or a
   rising loss). Unknown (no loss reported): 1.
4. Clamped to the configured bounds: [min_steps, max_steps] and at most `max_seconds` of wall
   time between saves (30 min by default, as before this rule).

`expected_loss_s`, the work a failure loses on average, is half the interval (failures land
uniformly within it); the restart itself comes on top.

Before any save of the run has been measured (a first attempt, or a relaunch of a run that never
got to save), the rule has no C and no step time, so `first_save` saves early to measure them,
at step `FIRST_SAVE_STEPS` (2): the first step carries the warm-up (allocations, autotuning,
compilation), so a save after the second one times a whole ordinary step and measures C at once;
the next interval then follows the rule. It costs one stall once per run (a relaunch that
inherits a measured cost chooses at once): about one step's time for a 25M-parameter model
with Adam on 2 shared CPU cores (a 0.59 s stall against a 0.62 s step). Waiting
instead (10 min, as this rule did before) is what made a run killed every few minutes from its
start never checkpoint and end in "crash loop". `min_steps` still holds: the first save comes
at max(FIRST_SAVE_STEPS, min_steps) (at most max_steps), and never later than `FIRST_SAVE_S`
(10 min: a first step longer than that is worth saving at once) or `max_seconds`. Failures
seen already (a relaunch whose earlier attempts died before their first save) shorten that
wall-time limit to half the observed MTBF: with failures arriving at random, about 60 % of
attempts (e^-0.5) live that long, so a run whose steps are slow still checkpoints before its
next failure more often than not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

PRIOR_MTBF_S = 24 * 3600.0
MIN_MTBF_S = 10.0  # below this an attempt is mostly its own start-up, not a failure rate
FIRST_SAVE_STEPS = 2  # before a save is measured: the first save's step (see the docstring)
FIRST_SAVE_S = 600.0  # ... and the longest time before it
MAX_SECONDS = 1800.0
LOSS_FALL_REF = 0.01
LOSS_FACTOR_MIN, LOSS_FACTOR_MAX = 0.5, 2.0
LOSS_MIN_POINTS = 8  # fewer losses than this: no trend


@dataclass(frozen=True, kw_only=True)
class CadenceBounds:
    """Limits on the interval `every="auto"` chooses: built from `Every(steps="auto",
    min_steps=, max_steps=, seconds=)` (worker/options.py); "auto" alone is `CadenceBounds()`."""

    min_steps: int = 1
    """Never save more often than every this many steps."""
    max_steps: int | None = None
    """Never save less often than every this many steps (None: no step limit)."""
    max_seconds: float = MAX_SECONDS
    """At most this much wall time between saves, whatever the rule says."""

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be at least 1, got {self.min_steps}")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError(f"max_steps ({self.max_steps}) must be at least min_steps "
                             f"({self.min_steps})")
        if self.max_seconds <= 0:
            raise ValueError(f"max_seconds must be positive, got {self.max_seconds}")


@dataclass(frozen=True, kw_only=True)
class Mtbf:
    """The mean time between failures in use, and where it comes from."""

    seconds: float
    source: str
    """"prior", "none in 3 h" or "2 failures in 5 min"."""
    observed: bool


@dataclass(frozen=True, kw_only=True)
class Cadence:
    """The interval chosen and everything it was chosen from (reported to the supervisor)."""

    every_steps: int
    reason: str
    """"every 40 steps: save stall 0.05 s, MTBF 3 h (prior)" and any factor or bound."""
    save_stall_s: float
    step_time_s: float
    mtbf_s: float
    mtbf_source: str
    loss_factor: float
    expected_loss_s: float
    """Work lost by a failure on average: half the interval (the restart comes on top)."""

    def fields(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class FirstSave:
    """When the first save comes before any save has been measured (`first_save`)."""

    every_steps: int
    every_seconds: float
    reason: str
    """"saving every 2 steps until a save is measured, at most 10 min apart" and any bound."""


def first_save(bounds: CadenceBounds, mtbf: Mtbf) -> FirstSave:
    """The schedule until a save has measured its stall and the step time (the module's
    docstring): early, to measure, within the bounds; failures seen shorten its time limit."""
    steps, why = FIRST_SAVE_STEPS, ""
    if bounds.min_steps > steps:
        steps, why = bounds.min_steps, f"; raised to min_steps {bounds.min_steps}"
    if bounds.max_steps is not None and bounds.max_steps < steps:
        steps, why = bounds.max_steps, f"; capped at max_steps {bounds.max_steps}"
    seconds = min(bounds.max_seconds, FIRST_SAVE_S)
    if mtbf.observed and mtbf.seconds / 2 < seconds:
        seconds = mtbf.seconds / 2
        why += f"; half the MTBF {span(mtbf.seconds)} ({mtbf.source})"
    return FirstSave(every_steps=steps, every_seconds=seconds,
                     reason=f"saving every {steps:,} step{'s' if steps > 1 else ''} until a "
                            f"save is measured, at most {span(seconds)} apart{why}")


def mtbf(failures: int | None, run_s: float | None, prior_s: float = PRIOR_MTBF_S) -> Mtbf:
    """Rule 1. `failures`: work-losing failures of the run so far; `run_s`: seconds its
    attempts ran (both None when the supervisor did not say: run by hand)."""
    run_s = max(0.0, run_s or 0.0)
    if failures:
        return Mtbf(seconds=max(MIN_MTBF_S, run_s / failures), observed=True,
                    source=f"{failures} failure{'s' if failures > 1 else ''} in {span(run_s)}")
    if run_s > prior_s:
        return Mtbf(seconds=run_s, source=f"none in {span(run_s)}", observed=False)
    return Mtbf(seconds=prior_s, source="prior", observed=False)


def loss_trend(points: Sequence[tuple[int, float]]) -> float | None:
    """Relative fall of the loss per step over `points` ((step, loss), oldest first): the
    mean of the newer half against the older half, over the steps between their centres.
    Positive: falling. None: too few finite points, or no steps between them."""
    pts = [(s, v) for s, v in points if math.isfinite(v)]
    if len(pts) < LOSS_MIN_POINTS:
        return None
    half = len(pts) // 2
    old, new = pts[:half], pts[half:]
    old_loss = sum(v for _, v in old) / len(old)
    new_loss = sum(v for _, v in new) / len(new)
    steps = sum(s for s, _ in new) / len(new) - sum(s for s, _ in old) / len(old)
    if steps <= 0 or old_loss == 0:
        return None
    return (old_loss - new_loss) / abs(old_loss) / steps


def loss_factor(fall: float | None) -> float:
    """Rule 3: `fall` is the loss's relative fall over one interval (None: unknown)."""
    if fall is None:
        return 1.0
    if fall <= 0:
        return LOSS_FACTOR_MAX
    return min(LOSS_FACTOR_MAX, max(LOSS_FACTOR_MIN, math.sqrt(LOSS_FALL_REF / fall)))


def interval(*, save_stall_s: float, step_time_s: float, mtbf: Mtbf,
             loss_per_step: float | None, bounds: CadenceBounds) -> Cadence:
    """The interval in steps that loses the least expected time (the module's rules)."""
    stall = max(save_stall_s, 0.0)
    step_time = max(step_time_s, 1e-9)
    ideal = math.sqrt(2 * stall * mtbf.seconds) / step_time
    factor = loss_factor(None if loss_per_step is None else loss_per_step * max(ideal, 1.0))
    steps = ideal * factor
    why = ""
    if factor < 1:
        why = f"; loss falling fast: x{factor:.2g}"
    elif factor > 1:
        why = f"; loss flat: x{factor:.2g}"
    by_time = bounds.max_seconds / step_time
    if steps > by_time:
        steps, why = by_time, why + f"; capped at {span(bounds.max_seconds)} between saves"
    if bounds.max_steps is not None and steps > bounds.max_steps:
        steps, why = bounds.max_steps, why + f"; capped at max_steps {bounds.max_steps}"
    if steps < bounds.min_steps and bounds.min_steps > 1:  # every step needs no reason
        steps, why = bounds.min_steps, why + f"; raised to min_steps {bounds.min_steps}"
    n = max(1, math.floor(steps))
    return Cadence(
        every_steps=n, save_stall_s=stall, step_time_s=step_time, mtbf_s=mtbf.seconds,
        mtbf_source=mtbf.source, loss_factor=factor, expected_loss_s=n * step_time / 2,
        reason=(f"every {n:,} step{'s' if n > 1 else ''}: save stall {stall:.2g} s, "
                f"MTBF {span(mtbf.seconds)} ({mtbf.source}){why}"))


def span(seconds: float) -> str:
    """A duration for a reason sentence: "12 s", "40 min", "3 h", "24 h", "2.5 d"."""
    if seconds < 60:
        return f"{seconds:.2g} s"
    if seconds < 3600:
        return f"{seconds / 60:.2g} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.2g} h"
    return f"{seconds / 86400:.2g} d"
