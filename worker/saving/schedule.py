"""When to save: a pure decision from the step, the clock and the last save."""

from __future__ import annotations

from dataclasses import dataclass


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

    def due(self, step: int, *, last_step: int | None, now: float, last_time: float,
            epoch_end: bool = False) -> bool:
        if last_step is not None and step <= last_step:
            return False
        if epoch_end and self.on_epoch_end:
            return True
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds and now - last_time >= self.every_seconds)
