"""Where a save that falls due at a step boundary goes: a pure decision.

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
