"""Where a save that falls due at a step boundary goes, and what a save handed to rtrain costs:
pure decisions, and the one measure they read (`CopyWatch`: how long rtrain's copy took).

Rules, in order:
1. Nothing is due and no stop was asked: no save.
2. A stop request (preemption), `request_save()` (and a handed save that failed, which the
   Checkpointer turns into one) go to disk from this process: they must be durable before
   `maybe_save` returns or the process exits, whoever else is alive then.
3. A save the schedule calls for goes to rtrain when the memory tier can take it: a snapshot of
   the step, which rtrain copies into the checkpoint dir beside training (supervisor/memtier/
   diskcadence.py); the loop pays the snapshot, not the disk write. That holds for the tier the
   script names and for the one on by default alike: the default tier exists only under
   `rtrain launch` (the one that copies). A kill before rtrain's copy leaves the step in memory
   (the live state's mark until its snapshot committed: the optimizer's next step waits for
   that), and the attempt's end commits the newest; without the live state, a kill before the
   snapshot committed leaves the snapshot or checkpoint before.
4. Otherwise (no tier, the tier off, or a process group, whose ranks save collectively) the
   scheduled save goes to disk from this process.
"""

from __future__ import annotations

from enum import Enum


class Route(str, Enum):
    """What happens to a step boundary's save."""

    NONE = "none"  # nothing is due
    DISK = "disk"  # this process writes it, durable before maybe_save returns
    RTRAIN = "rtrain"  # a snapshot rtrain is asked to persist (a `persist` heartbeat)


def route(*, due: bool, stop: bool, requested: bool, tier_takes: bool) -> Route:
    """The route of this boundary's save. `due`: the schedule (or a request) calls for one;
    `stop`: a stop was requested; `requested`: `request_save()` (or a lost hand-off) asked for
    it; `tier_takes`: a single process's memory tier is on and can snapshot it."""
    if not (due or stop):
        return Route.NONE
    if stop or requested or not tier_takes:
        return Route.DISK
    return Route.RTRAIN


def cadence_cost(stall_s: float, copy_s: float | None) -> float:
    """What a handed save costs, for `every="auto"` (worker/saving/cadence.py): the loop's
    stall, plus how long rtrain's copy of the previous one took (None: none seen yet).

    Why the copy counts: it hashes, writes and fsyncs the same bytes the script's own save
    would have, on the same machine (0.3-0.4 s of CPU and 0.65-0.93 s for 120 MiB on a busy
    2-core machine). Counted at the stall alone (a few tens of ms), the interval would be about
    3 times shorter than a disk write's: at the MTBF floor (cadence.MIN_MTBF_S) a save every
    0.9 s on a 110 ms step, copies back to back beside training. Counted so, the interval is
    about what a disk write's would be, the loop pays only the stall, and copies are not asked
    for faster than rtrain makes them (sqrt(2 C M) exceeds C for any MTBF M above C/2)."""
    return stall_s + (copy_s or 0.0)


class CopyWatch:
    """How long rtrain took to copy the last handed save into the checkpoint dir, from the
    hand-off until the step boundary that finds it committed (at most a step late: so the
    cost is never under-counted). A save whose copy never shows (merged into a newer request,
    or failed) leaves the last measure in place."""

    def __init__(self) -> None:
        self.step: int | None = None  # the handed save not seen committed yet
        self._since = 0.0
        self.copy_s: float | None = None  # the newest copy's time

    def handed(self, step: int, now: float) -> None:
        self.step, self._since = step, now

    def committed(self, now: float) -> None:
        """The checkpoint of `step` is in the checkpoint dir now."""
        if self.step is not None:
            self.copy_s, self.step = max(0.0, now - self._since), None
