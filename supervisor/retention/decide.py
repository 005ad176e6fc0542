"""Which checkpoints to keep: one pure policy, used by the worker's in-process retention and
by `rtrain prune`.

Kept: the newest `keep` verified checkpoints, the best `keep_best` by `metric` (min or max),
every milestone (step a multiple of `milestone_every`), and always the newest verified one.
Checkpoints that fail verification are not counted as kept; those older than the newest verified
checkpoint are removed (and reported), newer ones are left for a person to look at.

`Plan.relied` names the kept checkpoints whose soundness the deletions depend on: the newest
verified one and the others kept by count or rank (newest `keep`, best `keep_best`). Were one of
them bad, another would have to be kept in its place, so the caller verifies them fully and plans
again (`retention.prune_dir`). Milestones and protected steps are kept whatever they hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    keep: int | None = 3
    """Newest verified checkpoints to keep; None keeps all."""
    keep_best: int = 0
    """Additionally keep this many best checkpoints by `metric`."""
    metric: str | None = None
    """Metric name (from `save(metrics=...)`) that ranks checkpoints for `keep_best`."""
    mode: Literal["min", "max"] = "min"
    """Whether lower (`min`, e.g. loss) or higher (`max`, e.g. accuracy) is better."""
    milestone_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""

    def __post_init__(self) -> None:
        if self.keep is not None and self.keep < 1:
            raise ValueError(
                f"keep must be at least 1 (got {self.keep}): the newest verified "
                "checkpoint is always kept"
            )
        if self.keep_best < 0 or self.milestone_every < 0:
            raise ValueError("keep_best and milestone_every must be 0 or more")
        if self.keep_best and not self.metric:
            raise ValueError("keep_best needs a metric name: set metric (e.g. 'loss')")
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")


@dataclass(frozen=True)
class Candidate:
    step: int
    ok: bool
    metrics: dict
    name: str = ""


@dataclass(frozen=True)
class Plan:
    keep: list[Candidate]
    delete: list[tuple[Candidate, str]]  # with the reason, for the report
    why: dict[int, str] = field(default_factory=dict)
    """Step -> why it is kept, for the report."""
    relied: list[Candidate] = field(default_factory=list)
    """Kept verified checkpoints the deletions depend on (see the module docstring)."""


def _metric(c: Candidate, name: str) -> float | None:
    v = c.metrics.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        v = float(v)  # an int of 400 digits in a hand-made manifest does not fit
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def plan(
    candidates: list[Candidate], policy: RetentionPolicy, protect: frozenset[int] = frozenset()
) -> Plan:
    """Decide what to keep and delete; `protect` lists steps that must stay (e.g. in flight)."""
    by_step = sorted(candidates, key=lambda c: c.step, reverse=True)
    good = [c for c in by_step if c.ok]
    why: dict[int, list[str]] = {}

    def keep_for(steps: list[int], reason: str) -> None:
        for step in steps:
            why.setdefault(step, []).append(reason)

    relied: list[Candidate] = good[:1]  # the newest verified checkpoint is never deleted
    keep_for([c.step for c in good[:1]], "the newest that verifies")
    if policy.keep is None:
        keep_for([c.step for c in good[1:]], "keep all")
    else:
        relied += good[1:policy.keep]
        keep_for([c.step for c in good[1:policy.keep]], f"among the newest {policy.keep}")
    if policy.keep_best and policy.metric:
        scored = [(m, c) for c in good if (m := _metric(c, policy.metric)) is not None]
        scored.sort(key=lambda mc: mc[0], reverse=policy.mode == "max")
        best = [c for _, c in scored[: policy.keep_best]]
        relied += [c for c in best if c not in relied]
        keep_for([c.step for c in best],
                 f"among the best {policy.keep_best} by {policy.metric} ({policy.mode})")
    if policy.milestone_every:
        keep_for([c.step for c in good if c.step % policy.milestone_every == 0],
                 f"a milestone (every {policy.milestone_every} steps)")
    keep_for(sorted(protect), "protected (a save in flight)")
    newest_good = good[0].step if good else None
    keep, delete = [], []
    for c in by_step:
        if c.step in why:
            keep.append(c)
        elif c.ok:
            delete.append((c, "beyond the retention policy"))
        elif newest_good is not None and c.step < newest_good:
            delete.append((c, "failed verification and a newer checkpoint verifies"))
        else:
            keep.append(c)  # a failed checkpoint newer than any good one: leave it to a person
            keep_for([c.step], "failed verification but newer than any that verifies: "
                               "left for a person to look at")
    return Plan(keep, delete, {step: "; ".join(reasons) for step, reasons in why.items()},
                relied)
