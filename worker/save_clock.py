"""When the next save is due, and the step heartbeat that tells the supervisor so.

`SaveSchedule` decides from the step, the clock and the last save; this keeps what it decides
from (the last saved step, when the last save began, a pending `request_save`) and sends each
step's heartbeat (loss, samples since the last beat, the next scheduled save step).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from worker import runtime
from worker.schedule import SaveSchedule


class SaveClock:
    def __init__(self, schedule: SaveSchedule,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.schedule = schedule
        self.clock = clock
        self.last_step: int | None = None  # saved (or resumed from) last
        self.last_time = clock()  # when the last save began, or the start
        self.requested = False  # save at the next step whatever the schedule says
        self._samples = 0  # samples seen at the last heartbeat

    def tick(self, step: int, *, loss: float | None, samples: int | None,
             epoch_end: bool) -> bool:
        """Send this step's heartbeat; whether a save is due at it."""
        now = self.clock()
        n = self.schedule.every_steps
        runtime.heartbeat(step=step, loss=loss,
                          samples=None if samples is None else samples - self._samples,
                          next_save_step=(step // n + 1) * n if n else None)
        self._samples = samples or 0
        return self.requested or self.schedule.due(
            step, last_step=self.last_step, now=now, last_time=self.last_time,
            epoch_end=epoch_end)

    def save_begins(self) -> None:
        """A save starts: a request is served, and timed saves count from now."""
        self.requested = False
        self.last_time = self.clock()

    def resumed(self, step: int, samples: int | None) -> None:
        self.last_step = step
        self._samples = samples or 0
