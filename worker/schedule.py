"""When to save: a pure decision from the step, the clock and the last save."""

from __future__ import annotations

from dataclasses import dataclass

AUTO_SAVES_PER_RUN = 20
AUTO_MAX_SECONDS = 1800.0


@dataclass(frozen=True, kw_only=True)
class SaveSchedule:
    every_steps: int | None = None
    """Save when `step` is a multiple of this."""
    every_seconds: float | None = None
    """Save when this much wall time has passed since the last save (or the start)."""
    on_epoch_end: bool = False
    """Save when `maybe_save(..., epoch_end=True)` is called."""

    def __post_init__(self) -> None:
        if self.every_steps is not None and self.every_steps < 1:
            raise ValueError(f"every_steps must be at least 1, got {self.every_steps}")
        if self.every_seconds is not None and self.every_seconds <= 0:
            raise ValueError(f"every_seconds must be positive, got {self.every_seconds}")

    @classmethod
    def auto(cls, total_steps: int, on_epoch_end: bool = False) -> SaveSchedule:
        """About 20 checkpoints over the run, and at least one every 30 minutes: a crash then
        costs at most ~5% of the run or half an hour, whichever is less."""
        if total_steps < 1:
            raise ValueError("every='auto' needs total_steps (the run's length in steps)")
        return cls(every_steps=max(1, round(total_steps / AUTO_SAVES_PER_RUN)),
                   every_seconds=AUTO_MAX_SECONDS, on_epoch_end=on_epoch_end)

    def due(self, step: int, *, last_step: int | None, now: float, last_time: float,
            epoch_end: bool = False) -> bool:
        if last_step is not None and step <= last_step:
            return False
        if epoch_end and self.on_epoch_end:
            return True
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds and now - last_time >= self.every_seconds)
