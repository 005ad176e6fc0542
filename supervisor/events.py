"""`events.jsonl`: the append-only record of everything the supervisor saw and decided.

One JSON object per line: `v` (schema version), `time` (unix seconds), `seq` (1, 2, ... across
supervisor restarts), `kind`, then the event's own fields. Each line goes out in a single
`write` on an O_APPEND descriptor, so a line is never interleaved or buffered in the process;
only events a post-mortem needs (launch, exit, decisions, give-up...) pay for an fsync.
A supervisor killed mid-write leaves a torn last line: readers skip it, and the next writer
cuts it off before appending, so it never becomes a corrupt line in the middle.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.errors import RtrainError
from supervisor.filemode import DEFAULT_FILE_MODE, set_mode

log = logging.getLogger(__name__)

EVENTS_VERSION = 1

# Losing one of these to a power cut would hide why the run did what it did.
# Events that end a run are synced at once; the others reach the disk at the next `sync()`
# (the launch loop syncs once per decision), which keeps relaunches fast.
DURABLE_KINDS = frozenset({"give_up", "finished", "preempted", "requeue", "lock_takeover"})
# Other kinds so far: heartbeat_summary, checkpoint, skipped_checkpoint, gpu_release_wait,
# hook_failed.

Listener = Callable[[dict[str, Any]], None]

_TAIL_BYTES = 64 * 1024  # enough to hold the last complete line of any event


class EventLogError(RtrainError):
    """events.jsonl holds something this version cannot read."""


class EventLog:
    """Appends events to `path`; `clock` returns unix seconds (inject a fake one in tests).

    Each of `listeners` is called with every event after it is written (metrics, hooks). A
    listener that raises is logged and skipped: observers never break supervision."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.time,
                 listeners: list[Listener] | tuple[Listener, ...] = (),
                 mode: int = DEFAULT_FILE_MODE) -> None:
        self.path = Path(path)
        self.clock = clock
        self.listeners = list(listeners)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
        set_mode(self._fd, mode)  # the run's file-mode policy, also for an older log
        self._seq = self._recover()

    def _recover(self) -> int:
        """Cut a torn last line off and return the last seq written."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return 0
        with self.path.open("rb") as f:
            f.seek(max(size - _TAIL_BYTES, 0))
            tail = f.read()
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1  # 0 when the whole tail is one torn line
            os.truncate(self.path, size - (len(tail) - cut))
            tail = tail[:cut]
        for line in reversed(tail.splitlines()):
            try:
                return int(json.loads(line)["seq"])
            except (ValueError, KeyError, TypeError):
                continue
        return 0

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it. Field values must be JSON-able (Paths become str)."""
        self._seq += 1
        event = {"v": EVENTS_VERSION, "time": self.clock(), "seq": self._seq, "kind": kind,
                 **fields}
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())
        if kind in DURABLE_KINDS:
            os.fsync(self._fd)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # an observer's bug must not stop supervision: log it, go on
                log.exception("event listener %r failed on a %s event", listener, kind)
        return event

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events in order. A torn last line is skipped; a bad line elsewhere, or a newer
    schema version, raises EventLogError naming the line."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    torn_tail = lines.pop()  # b"" when the file ends with a newline
    events = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            event = json.loads(raw)
        except ValueError:
            raise EventLogError(f"{path}:{number}: not a JSON event; move the file aside to "
                                "start a new log") from None
        if not isinstance(event, dict) or event.get("v") != EVENTS_VERSION:
            version = event.get("v") if isinstance(event, dict) else None
            raise EventLogError(f"{path}:{number}: event schema version {version!r} is not "
                                f"{EVENTS_VERSION}; read it with the rtrain that wrote it")
        events.append(event)
    if torn_tail.strip():
        try:  # a complete last event that only lacks its newline is still an event
            event = json.loads(torn_tail)
            if isinstance(event, dict) and event.get("v") == EVENTS_VERSION:
                events.append(event)
        except ValueError:
            pass  # torn by a kill mid-write: the event never happened
    return events
