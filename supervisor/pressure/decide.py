"""Memory pressure: when to ask the child for relief, when to stop it for a rung down, and
whether a rung given up for memory fits again. Pure functions of readings and time.

While an attempt runs, the watch samples memory (pressure/monitor.py) and feeds every reading
(host: the run's cgroup or the machine; each GPU) to `advance`, which acts on two rules:

- **The trend.** Each memory's peaks per window (`Rule.peak_window_s`: a step's transient
  peak is in its window's peak, and a window without it does not pull the line down) over the
  last `Rule.trend_s` give a growth rate: the median of the pairwise slopes (Theil-Sen), and no
  more than the same over the newer half of the window (a start-up ramp that levelled off is
  not a trend; one spike moves a median little). With it, the time left until the limit from
  the newest peak. Acting takes time: the relieve request is answered at a step boundary, the
  stop costs the rest of a step and a save. Both are measured on this run (`Timings`, with
  priors before any measurement), multiplied by `Rule.margin`, plus two sample intervals
  (the newest reading may be one old, the next look is one away). Time left shorter than
  relief and the stop together: RELIEVE; shorter than the stop alone: DEGRADE, after relief
  was tried or at once when there is no time for it. A growth indistinguishable from the
  noise around it, below `Rule.trend_from` of the limit, or seen over fewer than `MIN_PEAKS`
  windows is no trend.
- **The hard line.** Usage at or above its `fraction` of the limit for `sustain_s`: RELIEVE;
  still above `sustain_s` after the worker answered: DEGRADE. The rule of a slow creep the
  trend cannot see; high enough that a run flat just below it is left alone.

Before either acts, `Verdict.rising` says pressure builds (the hard line crossed, not yet for
`sustain_s`; the trend's time left within `RISING` times what acting takes): room that costs the
run nothing is made first.

DEGRADE asks the child to save and exit, and the next attempt runs one rung down the ladder —
a degradation with no lost steps instead of a kernel OOM kill that loses everything since the
last checkpoint. Once neither rule holds, the stretch is over and relief may be asked again.

Climbing back (`climb_fits`): each rung's peak footprint is recorded (`rung_peak`) and a
degraded run climbs only when the rung above, as measured, fits under its threshold with
`headroom` to spare against the limits the last attempt saw.
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

PRIOR_STEP_S = 1.0
"""A step's duration before the run has measured one: relief is answered at a step boundary,
and the stop's save waits for one."""
PRIOR_SAVE_S = 2.0
"""A save's duration before the run has measured one."""
MIN_PEAKS = 5
"""Window peaks a trend needs (its newer half: at least 3)."""
RISING = 2.0
"""Pressure is rising (`Verdict.rising`: room is made where it costs the run nothing, e.g. the
warm standby is dropped) above the hard line, or when the trend's time left is under this many
times what relief and the stop take."""
NOISE_FACTOR = 3.0
"""The rise across the trend window must exceed this many times the median distance of the
peaks from the fitted line: otherwise it is noise."""


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
    fraction: float  # the hard line: used >= fraction * limit is pressure (0: not watched)

    @property
    def share(self) -> float:
        return self.used / self.limit if self.limit > 0 else 0.0

    @property
    def watched(self) -> bool:
        return self.fraction > 0 and self.limit > 0

    @property
    def over(self) -> bool:
        return self.watched and self.used >= self.fraction * self.limit

    def describe(self) -> str:
        name = {"cgroup": "the run's cgroup", "host": "host memory"}.get(self.source,
                                                                         self.source.upper())
        return (f"{name} at {self.used / 2**20:.0f} MiB of {self.limit / 2**20:.0f} MiB "
                f"({self.share:.0%}, threshold {self.fraction:.0%})")


def worst(readings: list[MemoryReading]) -> MemoryReading | None:
    """The reading closest to (or furthest past) its own threshold; None without any watched."""
    watched = [r for r in readings if r.watched]
    return max(watched, key=lambda r: r.share / r.fraction, default=None)


@dataclass(frozen=True, kw_only=True)
class Rule:
    """The settings `advance` applies (`[pressure]` and the watch's sample interval)."""

    sustain_s: float = 5.0
    trend_s: float = 8.0  # 0: no trend rule
    peak_window_s: float = 1.0
    trend_from: float = 0.5
    margin: float = 2.0
    interval_s: float = 1.0


@dataclass(frozen=True)
class Timings:
    """What acting takes on this run, as measured (None: not yet; the priors stand in)."""

    relieve_s: float | None = None  # from the relieve request to the worker's answer
    step_s: float | None = None  # a step, between two step heartbeats
    save_s: float | None = None  # a save, from its begin to its end heartbeat

    @property
    def relieve(self) -> float:
        if self.relieve_s is not None:
            return self.relieve_s
        return self.step_s if self.step_s is not None else PRIOR_STEP_S

    @property
    def stop(self) -> float:
        """The stop: the rest of the running step, then the save."""
        return ((self.step_s if self.step_s is not None else PRIOR_STEP_S)
                + (self.save_s if self.save_s is not None else PRIOR_SAVE_S))


@dataclass(frozen=True)
class Forecast:
    """A memory's trend: the newest peak, its growth rate and the time left until its limit."""

    reading: MemoryReading
    peak: int  # bytes
    rate: float  # bytes per second
    left_s: float

    def describe(self) -> str:
        return (f"{self.reading.describe()}, growing {self.rate / 2**20:.1f} MiB/s: "
                f"about {self.left_s:.1f} s to its limit")


Peaks = tuple[tuple[float, int], ...]  # (window start, the peak in it), oldest first


@dataclass(frozen=True)
class PressureState:
    over_since: float | None = None  # when the current stretch above the hard line began
    relieved_at: float | None = None  # when relief was asked (or answered) in this stretch
    degraded: bool = False  # DEGRADE was answered: nothing more to ask of this attempt
    peaks: dict[str, Peaks] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Verdict:
    """What to do, about which memory, and the sentence that says why."""

    act: Act = Act.NONE
    reading: MemoryReading | None = None
    why: str = ""
    left_s: float | None = None  # the trend's time left, when the trend decided
    rising: bool = False  # pressure is building (see `advance`): make room before acting


def add_peak(peaks: Peaks, now: float, used: int, rule: Rule) -> Peaks:
    """`peaks` with the sample `used` at `now` in it, windows older than the trend dropped."""
    if peaks and now - peaks[-1][0] < rule.peak_window_s:
        start, peak = peaks[-1]
        peaks = (*peaks[:-1], (start, max(peak, used)))
    else:
        peaks = (*peaks, (now, used))
    keep = now - max(rule.trend_s, rule.peak_window_s)
    return tuple(p for p in peaks if p[0] >= keep)


def _slope(points: Peaks) -> float:
    return statistics.median((b[1] - a[1]) / (b[0] - a[0])
                             for i, a in enumerate(points) for b in points[i + 1:]
                             if b[0] > a[0])


def forecast(peaks: Peaks, reading: MemoryReading, rule: Rule) -> Forecast | None:
    """The trend of one memory from its window peaks; None when there is none to act on."""
    if rule.trend_s <= 0 or reading.limit <= 0 or len(peaks) < MIN_PEAKS:
        return None
    newer = peaks[len(peaks) // 2:]
    rate = min(_slope(peaks), _slope(newer))
    peak = max(p for _, p in peaks[-3:])
    if rate <= 0 or peak < rule.trend_from * reading.limit:
        return None
    whole = _slope(peaks)
    base = statistics.median(p - whole * t for t, p in peaks)
    noise = statistics.median(abs(p - base - whole * t) for t, p in peaks)
    if whole * (peaks[-1][0] - peaks[0][0]) <= NOISE_FACTOR * noise:
        return None
    return Forecast(reading, peak, rate, max(0.0, (reading.limit - peak) / rate))


def advance(state: PressureState, readings: list[MemoryReading], now: float, rule: Rule,
            timings: Timings = Timings()) -> tuple[PressureState, Verdict]:
    """The next state and what to do, for one sample of every memory at `now`."""
    watched = [r for r in readings if r.watched]
    peaks = {r.source: add_peak(state.peaks.get(r.source, ()), now, r.used, rule)
             for r in watched}
    state = replace(state, peaks=peaks)
    if state.degraded:
        return state, Verdict()
    trends = [f for r in watched if (f := forecast(peaks[r.source], r, rule)) is not None]
    soonest = min(trends, key=lambda f: f.left_s, default=None)
    # Two intervals: the newest reading may be one old, and the next look is one away.
    stop_needs = timings.stop * rule.margin + 2 * rule.interval_s
    relief_needs = (timings.relieve + timings.stop) * rule.margin + 2 * rule.interval_s
    hard = worst(watched)
    if hard is None or not hard.over:
        hard = None
    over_since = None if hard is None else (now if state.over_since is None
                                            else state.over_since)
    state = replace(state, over_since=over_since)
    if soonest is not None and soonest.left_s < stop_needs:
        tried = ("relief did not make room" if state.relieved_at is not None
                 else "no time to try relief")
        return replace(state, degraded=True), Verdict(
            Act.DEGRADE, soonest.reading, f"{soonest.describe()}; the stop takes about "
            f"{timings.stop:.1f} s and {tried}", soonest.left_s)
    if state.relieved_at is None:
        rising = Verdict(reading=hard or (soonest.reading if soonest else None), rising=True,
                         why=hard.describe() if hard else soonest.describe() if soonest else "",
                         left_s=soonest.left_s if soonest else None)
        if soonest is not None and soonest.left_s < relief_needs:
            return replace(state, relieved_at=now), Verdict(
                Act.RELIEVE, soonest.reading, f"{soonest.describe()}; relief and the stop "
                f"take about {timings.relieve + timings.stop:.1f} s", soonest.left_s)
        if hard is not None and over_since is not None and now - over_since >= rule.sustain_s:
            return replace(state, relieved_at=now), Verdict(
                Act.RELIEVE, hard, f"{hard.describe()} for {now - over_since:.1f} s")
        if hard is not None or (soonest is not None and soonest.left_s < RISING * relief_needs):
            return state, rising
        return state, Verdict()
    since = max(state.relieved_at, over_since if over_since is not None else now)
    if hard is not None and now - since >= rule.sustain_s:
        return replace(state, degraded=True), Verdict(
            Act.DEGRADE, hard, f"{hard.describe()} for {now - since:.1f} s after relief")
    if hard is None and (soonest is None or soonest.left_s >= relief_needs):
        return replace(state, over_since=None, relieved_at=None), Verdict()  # it passed
    return state, Verdict()


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
