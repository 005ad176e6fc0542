"""Saves the worker had to skip (full disk, read-only or failing storage), from the events.

The worker reports each skipped save (a `save_skipped` heartbeat: step and reason); the launch
loop records it as a `save_skipped` event. Training goes on, so the run can end "finished"
with its newest checkpoint far behind: `unsaved_final` says so when the run stops, and
`rtrain status`, the report and the metrics count the skipped saves (`timeline.Timeline`
folds the events into `SkippedSaves`). Nothing here reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SkippedSaves:
    count: int = 0
    last_step: int | None = None
    last_reason: str = ""
    unsaved: str | None = None
    """The warning of the run's last ending, when its final state was not saved."""


def unsaved_final(last_step: int | None, newest_step: int | None,
                  skipped: list[dict[str, Any]]) -> str | None:
    """The warning for a run that stops with its last steps in no checkpoint because saves
    were skipped; None when nothing was skipped (a script may simply not save at its end) or
    the newest checkpoint holds the last step."""
    if not skipped or last_step is None:
        return None
    if newest_step is not None and newest_step >= last_step:
        return None
    where = (f"the newest checkpoint is at step {newest_step}" if newest_step is not None
             else "there is no checkpoint")
    last = skipped[-1]
    n = len(skipped)
    return (f"the final state (step {last_step}) was not saved: {where}; {n} save"
            f"{'s' if n != 1 else ''} skipped, the last at step {last.get('step')}: "
            f"{last.get('reason')}")
