"""When the next save is due, and the step heartbeat that tells the supervisor so.

`SaveSchedule` decides from the step, the clock and the last save; this keeps what it decides
from (the last saved step, when the last save began, a pending `request_save`) and sends each
step's heartbeat (loss, samples since the last beat, the next scheduled save step).

Under `every="auto"` (`bounds` given) it also measures what worker/saving/cadence.py chooses
from: the step time between saves, each save's stall and the recent losses; after every save it
replaces the schedule's `every_steps` with the new choice and reports it in a `cadence`
heartbeat. Each rank chooses for itself; saving is collective and due when any rank says so.
Until a save is measured it saves early to measure one (`first_schedule`, cadence.first_save).
A relaunch does not start from that guess when the run measured a save before: the supervisor
hands it the save stall and step time the run last measured (RTRAIN_SAVE_COST), and the first
interval is chosen from them and the failure record that now includes the failure just
recovered from.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from rtrain.supervisor.core.protocol import ENV_FAILURES, ENV_RUN_SECONDS, ENV_SAVE_COST
from rtrain.worker import runtime
from rtrain.worker.saving import cadence
from rtrain.worker.saving.schedule import SaveSchedule

LOSS_WINDOW = 256  # recent (step, loss) pairs the loss trend is read from

log = logging.getLogger(__name__)


class SaveClock:
    def __init__(self, schedule: SaveSchedule,
                 clock: Callable[[], float] = time.monotonic, *,
                 bounds: cadence.CadenceBounds | None = None) -> None:
        self.schedule = schedule
        self.clock = clock
        self.last_step: int | None = None  # saved (or resumed from) last
        self.last_time = clock()  # when the last save began, or the start
        self.requested = False  # save at the next step whatever the schedule says
        self.bounds = bounds  # None: a fixed schedule
        self.cadence: cadence.Cadence | None = None  # the last choice (auto only)
        self._samples = 0  # samples seen at the last heartbeat
        self._since: tuple[int, float] | None = None  # first step timed since the last save
        self._step_time: float | None = None  # measured up to the last save begun
        self._losses: deque[tuple[int, float]] = deque(maxlen=LOSS_WINDOW)
        self._announce = False  # a choice made before any step: reported at the first tick
        self._pending = False  # a save began under the first schedule and has not ended
        carried = _carried_cost() if bounds is not None else None
        if carried is not None:
            self._choose(*carried)
            self._announce = True

    def tick(self, step: int, *, loss: float | None, samples: int | None,
             epoch_end: bool) -> bool:
        """Send this step's heartbeat; whether a save is due at it."""
        now = self.clock()
        if self._pending:
            # That save was skipped (no room, a storage error): saving every few steps until
            # one succeeds would retry the failing write that often. The first schedule's
            # time limit stays; a save that succeeds chooses the interval.
            self._pending = False
            self.schedule = replace(self.schedule, every_steps=None)
        if self.bounds is not None:
            if self._since is None:
                self._since = (step, now)
            if loss is not None:
                self._losses.append((step, loss))
        if self._announce and self.cadence is not None:
            self._announce = False
            runtime.heartbeat(step=step, event="cadence", cadence=self.cadence.fields())
        n = self.schedule.every_steps
        runtime.heartbeat(step=step, loss=loss,
                          samples=None if samples is None else samples - self._samples,
                          next_save_step=(step // n + 1) * n if n else None)
        self._samples = samples or 0
        return self.requested or self.schedule.due(
            step, last_step=self.last_step, now=now, last_time=self.last_time,
            epoch_end=epoch_end)

    def save_begins(self, step: int | None = None) -> None:
        """A save starts: a request is served, and timed saves count from now."""
        self.requested = False
        self.last_time = self.clock()
        self._pending = self.bounds is not None and self.cadence is None
        if self._since is not None and step is not None and step > self._since[0]:
            # Steps between saves only: the stall is measured on its own.
            self._step_time = (self.last_time - self._since[1]) / (step - self._since[0])
        self._since = None

    def save_ended(self, step: int, stall_s: float) -> None:
        """A save committed (or went to the background) after blocking training `stall_s`:
        under "auto", choose the next interval from it."""
        self._pending = False
        if self.bounds is None or self._step_time is None:
            return  # no step timed yet (a save at the first step): keep the schedule
        self._choose(stall_s, self._step_time)
        self._announce = False
        runtime.heartbeat(step=step, event="cadence", cadence=self.cadence.fields())

    def _choose(self, stall_s: float, step_time_s: float) -> None:
        assert self.bounds is not None
        self.cadence = cadence.interval(
            save_stall_s=stall_s, step_time_s=step_time_s, mtbf=run_mtbf(),
            loss_per_step=cadence.loss_trend(self._losses), bounds=self.bounds)
        self.schedule = replace(self.schedule, every_steps=self.cadence.every_steps,
                                every_seconds=self.bounds.max_seconds)

    def resumed(self, step: int, samples: int | None) -> None:
        self.last_step = step
        self._samples = samples or 0
        self._since = None  # the first step after a restore is timed from, not the restore


def first_schedule(bounds: cadence.CadenceBounds, on_epoch_end: bool) -> SaveSchedule:
    """The schedule under "auto" until a save is measured: cadence.first_save, from the
    failures the supervisor passed in."""
    first = cadence.first_save(bounds, run_mtbf())
    log.info("save cadence: %s", first.reason)
    return SaveSchedule(every_steps=first.every_steps, every_seconds=first.every_seconds,
                        on_epoch_end=on_epoch_end)


def run_mtbf() -> cadence.Mtbf:
    """The run's MTBF from the failure record the supervisor passed in (the prior without)."""
    failures = _env_number(ENV_FAILURES)
    return cadence.mtbf(None if failures is None else int(failures),
                        _env_number(ENV_RUN_SECONDS))


def _carried_cost() -> tuple[float, float] | None:
    """(save stall, step time) the run measured before this attempt, if the supervisor said."""
    try:
        cost = json.loads(os.environ[ENV_SAVE_COST])
        stall, step = float(cost["save_stall_s"]), float(cost["step_time_s"])
    except (KeyError, ValueError, TypeError):
        return None
    if not (math.isfinite(stall) and math.isfinite(step)) or stall < 0 or step <= 0:
        return None
    return stall, step


def _env_number(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None
