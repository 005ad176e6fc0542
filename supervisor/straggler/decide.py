"""Which rank is a straggler: a pure rule over each rank's recent step timings.

Every step heartbeat of a rank carries its mean step interval (`step_s`) and the mean time per
step it waited for the other ranks (`wait_s`) since its previous step heartbeat: at rtrain's
step-boundary collective, and inside DDP's gradient all-reduce where the worker times it
(worker/commwait.py; a rank slower in its forward or backward is waited for there). A rank's
*busy* time is `step_s - wait_s`: the time it spent on the step itself. Ranks that synchronise
every step have equal step intervals, so the slow one is not the one with the longest step but
the one the others wait for: the most busy, the least waiting.

The rule, over the window (samples whose step lies within the last `window_steps` steps of the
newest sample of any rank):

- fewer than two ranks with at least `min_samples` samples in the window: nothing is said;
- a rank's busy time is the median of its samples (one slow step, a save, a garbage
  collection, moves no median);
- a rank is a straggler when its busy time is at least `factor` times the median of the
  other ranks' busy times (and that median is positive).

A rank that was slow once and recovered has a normal median; one that stays slow for more than
half of the window is named. Noise between equal ranks stays far below the default factor.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """One step heartbeat's timings of one rank."""

    step: int
    step_s: float
    """Mean step interval since the rank's previous step heartbeat."""
    wait_s: float = 0.0
    """Mean time per step spent waiting for the other ranks (step boundary, DDP all-reduce)."""

    @property
    def busy_s(self) -> float:
        return max(0.0, self.step_s - self.wait_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerRule:
    """The rule's numbers (`[straggler]` in config.py owns their defaults and meaning)."""

    factor: float
    window_steps: int
    min_samples: int

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise ValueError("straggler factor must be above 1")
        if self.window_steps < 1 or self.min_samples < 1:
            raise ValueError("straggler window_steps and min_samples must be at least 1")


@dataclass(frozen=True, kw_only=True, slots=True)
class Pace:
    """One rank's busy time against the other ranks' over the window; the rank is a straggler
    when `ratio` reaches the rule's factor."""

    rank: int
    step: int
    """The newest step of the rank in the window."""
    busy_s: float
    """The rank's median busy time per step."""
    others_busy_s: float
    """The median of the other ranks' busy times."""
    ratio: float
    """busy_s / others_busy_s (infinite when the others' is 0)."""
    samples: int
    """The rank's samples in the window."""

    def slower_by(self, factor: float) -> bool:
        """Whether this rank is at least `factor` times slower than the others."""
        return self.others_busy_s > 0 and self.ratio >= factor

    def describe(self) -> str:
        return (f"rank {self.rank} is {self.ratio:.2f}x slower than the other ranks "
                f"({self.busy_s * 1000:.0f} ms per step against {self.others_busy_s * 1000:.0f} "
                f"ms, median of {self.samples} samples up to step {self.step}; the others wait "
                f"for it)")


def in_window(samples: Mapping[int, Sequence[StepSample]],
              window_steps: int) -> dict[int, list[StepSample]]:
    """Each rank's samples within the last `window_steps` steps of the newest one."""
    newest = max((s.step for seq in samples.values() for s in seq), default=None)
    if newest is None:
        return {}
    low = newest - window_steps
    return {rank: [s for s in seq if s.step > low] for rank, seq in samples.items()}


def paces(samples: Mapping[int, Sequence[StepSample]], rule: StragglerRule) -> dict[int, Pace]:
    """Every rank that can be judged now (enough samples in the window, and at least one other
    such rank), against the others."""
    window = {rank: seq for rank, seq in in_window(samples, rule.window_steps).items()
              if len(seq) >= rule.min_samples}
    if len(window) < 2:
        return {}
    busy = {rank: statistics.median(s.busy_s for s in seq) for rank, seq in window.items()}
    out = {}
    for rank in sorted(window):
        others = statistics.median(b for r, b in busy.items() if r != rank)
        ratio = busy[rank] / others if others > 0 else (math.inf if busy[rank] > 0 else 1.0)
        out[rank] = Pace(rank=rank, step=max(s.step for s in window[rank]), busy_s=busy[rank],
                         others_busy_s=others, ratio=ratio, samples=len(window[rank]))
    return out


def stragglers(samples: Mapping[int, Sequence[StepSample]], rule: StragglerRule) -> list[Pace]:
    """The ranks slower than the others by `rule.factor` over the window, by rank."""
    return [p for p in paces(samples, rule).values() if p.slower_by(rule.factor)]
