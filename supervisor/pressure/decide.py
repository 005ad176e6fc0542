"""Memory pressure: when to ask the child for relief, when to stop it for a rung down, and
whether a rung given up for memory fits again. Pure functions of readings and time.

While an attempt runs, the watch samples memory (pressure/monitor.py) and feeds the worst
reading to `advance`. Above its threshold for `sustain_s`: RELIEVE (the worker frees caches,
steps its micro-batch down); still above `sustain_s` after that: DEGRADE (the child is asked to
save and exit, and the next attempt runs one rung down the ladder) — a degradation with no
lost steps instead of a kernel OOM kill that loses everything since the last checkpoint.
Dropping below the threshold at any point starts over. The second window restarts when the
worker answers the request (`answered`): whether relief helped is judged after it happened,
not while the step that will run it is still going.

Climbing back (`climb_fits`): each rung's peak footprint is recorded (`rung_peak`) and a
degraded run climbs only when the rung above, as measured, fits under its threshold with
`headroom` to spare against the limits the last attempt saw.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any


class Act(str, enum.Enum):
    NONE = "none"
    RELIEVE = "relieve"  # ask the child to free memory in-process
    DEGRADE = "degrade"  # ask the child to save and exit for a rung down


@dataclass(frozen=True)
class MemoryReading:
    """One memory the run can run out of: the host (its cgroup's limit, else the machine) or a
    GPU, with the share of it that counts as pressure."""

    source: str  # "cgroup", "host" or "gpu<N>"
    used: int  # bytes
    limit: int  # bytes
    fraction: float  # the threshold: used >= fraction * limit is pressure (0: not watched)

    @property
    def share(self) -> float:
        return self.used / self.limit if self.limit > 0 else 0.0

    @property
    def over(self) -> bool:
        return self.fraction > 0 and self.limit > 0 and self.used >= self.fraction * self.limit

    def describe(self) -> str:
        name = {"cgroup": "the run's cgroup", "host": "host memory"}.get(self.source,
                                                                         self.source.upper())
        return (f"{name} at {self.used / 2**20:.0f} MiB of {self.limit / 2**20:.0f} MiB "
                f"({self.share:.0%}, threshold {self.fraction:.0%})")


def worst(readings: list[MemoryReading]) -> MemoryReading | None:
    """The reading closest to (or furthest past) its own threshold; None without any watched."""
    watched = [r for r in readings if r.fraction > 0 and r.limit > 0]
    return max(watched, key=lambda r: r.share / r.fraction, default=None)


@dataclass(frozen=True)
class PressureState:
    over_since: float | None = None  # when the current stretch above the threshold began
    relieved_at: float | None = None  # when relief was asked in this stretch
    degraded: bool = False  # DEGRADE was answered: nothing more to ask of this attempt


def advance(state: PressureState, reading: MemoryReading | None, now: float,
            sustain_s: float) -> tuple[PressureState, Act]:
    """The next state and what to do, for one sample at `now`."""
    if state.degraded:
        return state, Act.NONE
    if reading is None or not reading.over:
        return PressureState(), Act.NONE  # relief worked, or it never was pressure
    since = now if state.over_since is None else state.over_since
    state = replace(state, over_since=since)
    if state.relieved_at is None:
        if now - since >= sustain_s:
            return replace(state, relieved_at=now), Act.RELIEVE
        return state, Act.NONE
    if now - state.relieved_at >= sustain_s:
        return replace(state, degraded=True), Act.DEGRADE
    return state, Act.NONE


def answered(state: PressureState, now: float) -> PressureState:
    """The worker says it relieved what it could (a `relieved` heartbeat) at `now`."""
    if state.relieved_at is None or state.degraded:
        return state
    return replace(state, relieved_at=now)


# ------------------------------------------------------------------ climbing back


def rung_peak(old: dict[str, Any] | None, *, host: int | None, host_limit: int | None,
              gpu: int | None, gpu_limit: int | None) -> dict[str, Any] | None:
    """A rung's recorded peak after one more attempt on it: the larger footprints, the newest
    limits. None when nothing was measured (and nothing was before)."""
    out = dict(old or {})
    for key, value in (("host", host), ("gpu", gpu)):
        if value:
            out[key] = max(value, out.get(key) or 0)
    for key, value in (("host_limit", host_limit), ("gpu_limit", gpu_limit)):
        if value:
            out[key] = value
    return out or None


def climb_fits(peak: dict[str, Any] | None, *, host_limit: int | None, gpu_limit: int | None,
               fraction: float, gpu_fraction: float, headroom: float) -> tuple[bool, str]:
    """Does the rung whose recorded peak is `peak` fit under the limits the run has now?
    (fits, the sentence saying why). The peak must stay `headroom` (a share of the limit)
    below the threshold; a rung never measured does not climb (nothing says it fits).
    Limits unknown now are taken from the record."""
    if not peak:
        return False, "no memory peak was recorded on that rung"
    checks = (("host", peak.get("host"), host_limit or peak.get("host_limit"), fraction),
              ("GPU", peak.get("gpu"), gpu_limit or peak.get("gpu_limit"),
               gpu_fraction or 1.0))
    said = []
    for name, used, limit, frac in checks:
        if not used:
            continue
        if not limit:
            return False, f"no {name} memory limit is known to compare its peak with"
        allowed = (frac - headroom) * limit
        share = f"{name} peak {used / 2**20:.0f} MiB of {limit / 2**20:.0f} MiB"
        if used > allowed:
            return False, f"{share} is above {frac - headroom:.0%} of it"
        said.append(share)
    if not said:
        return False, "no memory peak was recorded on that rung"
    return True, f"{', '.join(said)} fit with {headroom:.0%} headroom"
