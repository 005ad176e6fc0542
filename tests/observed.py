"""Observations for table tests, written as the facts read: `signal="SIGKILL"` for a child a
signal killed, `first_step_seen`, `stop_confirmed` and `stuck_summary` as the judgement reads
them; each becomes the Observation the watch would have handed out."""

from __future__ import annotations

import signal as _signal
from typing import Any

from rtrain.supervisor.decide.observation import Heartbeats, Observation


def observed(*, signal: str | None = None, first_step_seen: bool = False,
             stop_confirmed: bool = False, stuck_summary: str = "", **fields: Any) -> Observation:
    """Past start-up only when `first_step_seen` says so: a table names what it relies on."""
    if signal is not None:
        fields["returncode"] = -int(_signal.Signals[signal])
    fields["started"] = first_step_seen
    if stop_confirmed:
        fields["heartbeats"] = Heartbeats(count=1, last_event="stop")
    if stuck_summary:
        fields["stuck"] = {"summary": stuck_summary}
    return Observation(**fields)
