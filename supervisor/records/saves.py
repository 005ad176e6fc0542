"""Saves the worker had to skip (full disk, read-only or failing storage), from the events.

The worker reports each skipped save (a `save_skipped` heartbeat: step and reason); the launch
loop records it as a `save_skipped` event. Training goes on, so the run can end "finished"
with its newest checkpoint far behind: `unsaved_final` says so when the run stops, and
`rtrain status`, the report and the metrics count the skipped saves. Pure functions over event
dicts; nothing here reads a file.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

SKIPPED = "save_skipped"
UNSAVED = "final_state_unsaved"


@dataclass(frozen=True, kw_only=True)
class SkippedSaves:
    count: int = 0
    last_step: int | None = None
    last_reason: str = ""
    unsaved: str | None = None
    """The warning of the run's last ending, when its final state was not saved."""


def summarize(events: Iterable[dict[str, Any]]) -> SkippedSaves:
    """Skipped saves of the whole log, and whether the run's last ending left state unsaved
    (a later launch clears that: it may have saved since)."""
    count, last, unsaved = 0, None, None
    for e in events:
        kind = e.get("kind")
        if kind == SKIPPED:
            count, last = count + 1, e
        elif kind == UNSAVED:
            unsaved = str(e.get("reason") or "the final state was not saved")
        elif kind == "launch":
            unsaved = None
    step = last.get("step") if last is not None else None
    return SkippedSaves(count=count, last_step=step if isinstance(step, int) else None,
                        last_reason=str(last.get("reason") or "") if last is not None else "",
                        unsaved=unsaved)


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
