"""`events.jsonl`: the append-only record of everything the supervisor saw and decided.

One JSON object per line: `v` (schema version), `time` (unix seconds), `seq` (1, 2, ... across
supervisor restarts), `kind`, then the event's own fields. Each line goes out in a single
`write` on an O_APPEND descriptor, so a line is never interleaved or buffered in the process.
A supervisor killed mid-write leaves a torn last line: readers skip it, and the next writer
cuts it off before appending, so it never becomes a corrupt line in the middle.

`event_schema.KINDS` is the schema: every kind, the fields it carries, whether it is fsynced at once
(`durable`) and whether a hook may name it. `emit` refuses a kind or a field not in it
(`EventSchemaError`), so the log cannot drift from the table (docs/reference.md's Events
table is generated from it). Durable kinds are the few a post-mortem or a restarted
supervisor needs and that come at most once per attempt: `launch`, `decision` (its fsync
covers the attempt's `exit` and `classification` written just before it) and the ends of a
run; the others reach the disk with the next durable event, the launch loop's `sync()` per
relaunch, or `close()`.

Writing is best effort against the disk, never against order: when the disk is full or failing
(ENOSPC, EDQUOT, EIO) an event that cannot be written waits in memory (the rest of a line
written in part first) and goes out, in order, with the next `emit`, `sync` or `retry`; the
supervision goes on meanwhile. Past `PENDING_MAX` waiting events the newest are dropped and an
`events_lost` event with their count is written once there is room.

The file is opened and read through `ownfiles` (never through a link, never blocking on a FIFO,
refused when it has a second name: a one-line error, exit 2). A reader refuses a line nested
deeper than `MAX_DEPTH` (`EventLogError`, like any unreadable line): no event rtrain writes
comes close, and a deeper one would crash the recursive code that reads events (JSON parsing
itself, at some thousand levels).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rtrain.checkpoint.safeio import nested_deeper
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.errors import ExitCode, RtrainError
from rtrain.supervisor.core.event_schema import DURABLE_KINDS, KINDS, Kind
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE

log = logging.getLogger(__name__)

EVENTS_VERSION = 1



Listener = Callable[[dict[str, Any]], None]

_TAIL_BYTES = 64 * 1024  # enough to hold the last complete line of any event
PENDING_MAX = 10_000  # events held in memory while the disk refuses them
MAX_DEPTH = 64  # nesting of one event line; rtrain's own need a handful of levels


class EventLogError(RtrainError):
    """events.jsonl holds something this version cannot read."""

    exit_code = ExitCode.USAGE


class EventSchemaError(ValueError):
    """An event of a kind, or with a field, that `KINDS` does not have: a bug in the emitter,
    or a new kind or field not yet added to `KINDS` (then run scripts/gen_reference.py)."""


_ALLOWED = {k.value: frozenset(spec.fields + spec.optional) for k, spec in KINDS.items()}


def checked_kind(kind: Kind | str, fields: Iterable[str]) -> str:
    """The kind's name, once `kind` and every field name are in `KINDS`; else EventSchemaError."""
    try:
        name = Kind(kind).value
    except ValueError:
        raise EventSchemaError(f"{kind!r} is not an event kind: add it to events.KINDS and "
                               "run scripts/gen_reference.py") from None
    unknown = set(fields) - _ALLOWED[name]
    if unknown:
        raise EventSchemaError(f"{name} events have no field {', '.join(sorted(unknown))}: add "
                               "it to events.KINDS and run scripts/gen_reference.py")
    return name


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
        # Read and write: the torn tail is read back through the same descriptor.
        opened = ownfiles.open_own(self.path, os.O_RDWR | os.O_APPEND, create=True, mode=mode)
        self._fd = opened.fd
        ownfiles.own_mode(opened, mode)  # the run's file-mode policy, also for an older log
        self._seq = self._recover()
        self._pending: deque[bytes] = deque()  # lines not (completely) written yet, in order
        self._lost = 0  # events dropped with the queue full
        self._error: str | None = None  # why the disk refuses, while it does
        self._unsynced = False  # written since the last fsync

    def _recover(self) -> int:
        """Cut a torn last line off and return the last seq written."""
        size = os.fstat(self._fd).st_size
        if size == 0:
            return 0
        tail = os.pread(self._fd, _TAIL_BYTES, max(size - _TAIL_BYTES, 0))
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n") + 1  # 0 when the whole tail is one torn line
            os.ftruncate(self._fd, size - (len(tail) - cut))
            tail = tail[:cut]
        for line in reversed(tail.splitlines()):
            try:
                seq = json.loads(line)["seq"]
                if isinstance(seq, int) and not isinstance(seq, bool):
                    return seq
            except (ValueError, KeyError, TypeError, RecursionError):
                continue
        return 0

    def emit(self, kind: Kind | str, **fields: Any) -> dict[str, Any]:
        """Append one event and return it. Field values must be JSON-able (Paths become str).
        EventSchemaError for a kind or field that `KINDS` does not have."""
        name = checked_kind(kind, fields)
        self._seq += 1
        event = {"v": EVENTS_VERSION, "time": self.clock(), "seq": self._seq, "kind": name,
                 **fields}
        line = json.dumps(event, default=str, separators=(",", ":")) + "\n"
        if len(self._pending) < PENDING_MAX:
            self._pending.append(line.encode())
        else:
            self._lost += 1
        if self.retry() and name in DURABLE_KINDS:
            self.sync()
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:  # an observer's bug must not stop supervision: log it, go on
                log.exception("event listener %r failed on a %s event", listener, name)
        return event

    @property
    def pending(self) -> int:
        """Events waiting for room on the disk."""
        return len(self._pending) + (1 if self._lost else 0)

    def retry(self) -> bool:
        """Write what waits, in order; True when nothing is left waiting."""
        while self._pending:
            line = self._pending[0]
            try:
                n = os.write(self._fd, line)
            except OSError as e:
                if e.errno not in STORAGE_ERRNOS:
                    raise
                if self._error is None:
                    log.warning("cannot write %s (%s): events wait in memory until there is "
                                "room; supervision goes on", self.path, e.strerror)
                self._error = e.strerror
                return False
            self._unsynced = True
            if n < len(line):
                self._pending[0] = line[n:]  # the line's rest must come before anything else
                continue
            self._pending.popleft()
            if not self._pending and self._lost:
                lost, self._lost = self._lost, 0
                self._seq += 1
                note = {"v": EVENTS_VERSION, "time": self.clock(), "seq": self._seq,
                        "kind": Kind.EVENTS_LOST.value, "count": lost, "reason": self._error}
                self._pending.append((json.dumps(note, separators=(",", ":")) + "\n").encode())
        if self._error is not None:
            log.warning("%s is written again", self.path)
            self._error = None
        return True

    def sync(self) -> None:
        """Write what waits and fsync it; free when nothing was written since the last sync
        (the launch loop syncs before each relaunch, right after a durable `decision`)."""
        if not self.retry() or not self._unsynced:
            return
        try:
            os.fsync(self._fd)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            log.warning("cannot sync %s (%s)", self.path, e.strerror)
            return
        self._unsynced = False

    def close(self) -> None:
        """Write what waits and sync it: whatever the last events were, they outlive us."""
        if self._fd >= 0:
            self.sync()
            if self._pending or self._lost:
                log.warning("%d events could not be written to %s (%s)", self.pending,
                            self.path, self._error)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deep(raw: bytes) -> bool:
    """Whether one line nests deeper than MAX_DEPTH. Counting brackets first (at memchr
    speed) leaves the screen to the rare line that has that many at all."""
    return (raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
            and nested_deeper(raw, MAX_DEPTH))


def read_events(path: Path) -> list[dict[str, Any]]:
    """All events in order. A torn last line is skipped; a bad line elsewhere (not JSON, or
    nested deeper than MAX_DEPTH), or a newer schema version, raises EventLogError naming the
    line. RefusedFile when the file is not a regular file rtrain may read (a link, a FIFO)."""
    try:
        data = ownfiles.read_own(path)
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    torn_tail = lines.pop()  # b"" when the file ends with a newline
    events = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            if _deep(raw):
                raise EventLogError(f"{path}:{number}: an event nested more than {MAX_DEPTH} "
                                    "levels deep; move the file aside to start a new log")
            event = json.loads(raw)
        except (ValueError, RecursionError):
            raise EventLogError(f"{path}:{number}: not a JSON event; move the file aside to "
                                "start a new log") from None
        if not isinstance(event, dict) or event.get("v") != EVENTS_VERSION:
            version = event.get("v") if isinstance(event, dict) else None
            raise EventLogError(f"{path}:{number}: event schema version {version!r} is not "
                                f"{EVENTS_VERSION}; read it with the rtrain that wrote it")
        events.append(event)
    if torn_tail.strip() and not _deep(torn_tail):
        try:  # a complete last event that only lacks its newline is still an event
            event = json.loads(torn_tail)
            if isinstance(event, dict) and event.get("v") == EVENTS_VERSION:
                events.append(event)
        except (ValueError, RecursionError):
            pass  # torn by a kill mid-write: the event never happened
    return events
