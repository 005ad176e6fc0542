"""What `rtrain check-resume` asks of this process (RTRAIN_CHECK_RESUME), torch-free: where to
stop, and the entropy the process starts from.

The entropy. Python's `random` and numpy's global generator are seeded from the OS when they
are imported, and the Checkpointer saves and restores their states. A script that never seeds
them (most do not: they seed torch) therefore ends every run in other states of them, and two
uninterrupted runs would differ although they trained alike. check-resume hands the processes
that stand for the original run (the uninterrupted ones and the one it stops) the same
`entropy`; `import rtrain` seeds both generators with it, before the script's code after that
import seeds or draws, so the script's own seeding still wins (a seed set before that import is
replaced: what it draws before `restore()` then differs in a resumed run, a false difference).
A resumed run gets none, as a relaunch draws its own: what it draws before `restore()` replaces
the states is its own, so a script whose training depends on that is found inexact, as it is.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from rtrain.supervisor.core.protocol import ENV_CHECK_RESUME

STOPS = ("kill", "signal")


@dataclass(frozen=True)
class Plan:
    """What check-resume asked of this process."""

    stop_at: int | None = None
    stop: str | None = None  # "kill" or "signal"
    entropy: int | None = None  # the seed of python's and numpy's global generators


def plan() -> Plan | None:
    """The order in RTRAIN_CHECK_RESUME, None when unset. Raises ValueError on a bad value."""
    raw = os.environ.get(ENV_CHECK_RESUME)
    if not raw:
        return None
    try:
        d = json.loads(raw)
        stop_at, stop, entropy = d.get("stop_at"), d.get("stop"), d.get("entropy")
    except (ValueError, AttributeError):
        raise ValueError(f"{ENV_CHECK_RESUME} is not a JSON object: {raw[:80]!r}") from None
    if stop_at is not None and (not isinstance(stop_at, int) or stop_at < 0):
        raise ValueError(f"{ENV_CHECK_RESUME}: stop_at must be a step, not {stop_at!r}")
    if stop not in (None, *STOPS) or (stop is None) != (stop_at is None):
        raise ValueError(f"{ENV_CHECK_RESUME}: stop must be one of {STOPS} with stop_at")
    if entropy is not None and (not isinstance(entropy, int) or not 0 <= entropy < 2**32):
        raise ValueError(f"{ENV_CHECK_RESUME}: entropy must be an integer in [0, 2**32), "
                         f"not {entropy!r}")
    return Plan(stop_at, stop, entropy)


def seed_entropy() -> None:
    """At `import rtrain`: seed python's and numpy's global generators with the order's entropy,
    if it gives one. A bad order is left to the Checkpointer, which refuses it in one line."""
    try:
        order = plan()
    except ValueError:
        return
    if order is None or order.entropy is None:
        return
    random.seed(order.entropy)
    try:
        import numpy.random
    except ImportError:  # no numpy: no numpy generator to save either
        return
    numpy.random.seed(order.entropy)
