"""events.jsonl folded once into what `rtrain status`, `rtrain report` and the metrics file show.

`Timeline.add(event)` takes the events in order; `read_timeline(path)` reads the file once and
adds them all. The metrics writer, an EventLog listener, keeps one Timeline for the whole
launch, so by default little grows with the run's length: per attempt its launch, exit,
classification and decision, and per kind its last event. `keep_curve=True` (the report)
also keeps every `heartbeat_summary` and the events it marks on the curve.

Rules the readers share:
- attempts are numbered by their `launch` events; a later launch with the same number (a
  `--fresh` run numbers from 0 again) starts a new record;
- the rung in force is the `level` and `settings` of the last launch / decision / degrade;
- the newest step is that of the last `heartbeat_summary` or `exit` that names one;
- skipped saves are counted over the whole log; a `final_state_unsaved` warning holds until
  the next launch (which may have saved since);
- what failures cost: every `recovery` event, kept in order (records/recovery.py folds them);
- the failure record the worker's save cadence reads (`run_s`, `work_lost`) counts from the
  last launch of attempt 0 (a `--fresh` run starts its own record).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.records.events import read_events
from rtrain.supervisor.records.saves import SkippedSaves

Event = dict[str, Any]

_RUNG_KINDS = (Kind.LAUNCH, Kind.DECISION, Kind.DEGRADE)  # events that name the rung in force


def failure_kind(classification: Event) -> str:
    """The failure kind a `classification` event names (`kind` names the event itself)."""
    return str(classification.get("failure") or "unnamed")


# Endings that lose no training work: a preemption saved first, a startup failure ran no step,
# a bad checkpoint failed at load. Every other failure loses the steps since the last save.
NO_WORK_LOST = frozenset({FailureKind.PREEMPTED.value, FailureKind.STARTUP.value,
                          FailureKind.BAD_CHECKPOINT.value})


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(kw_only=True)
class AttemptRecord:
    """One attempt, from its `launch` event on."""

    number: int
    launch: Event
    exit: Event | None = None
    classification: Event | None = None
    decision: Event | None = None
    stuck: Event | None = None
    """At a hang: its `stuck_ranks` event (which rank is behind, where each rank is)."""
    last_step: int | None = None
    """Newest step its `heartbeat_summary` or `exit` events name."""

    @property
    def failure(self) -> str | None:
        """The failure kind of its classification, if it failed."""
        return None if self.classification is None else failure_kind(self.classification)


@dataclass(frozen=True, kw_only=True)
class Note:
    """An event the report marks on the run's curve (`classification`, `degrade`,
    `skipped_checkpoint`), with the attempt last named (by it or before it) and that attempt's
    newest step then."""

    event: Event
    attempt: int | None
    step: int | None


@dataclass(kw_only=True)
class MirrorRecord:
    """The mirror as the log tells it (the `mirror_*` events)."""

    uploaded_step: int | None = None
    """Step of the newest checkpoint uploaded."""
    uploaded_at: float | None = None
    uploads: int = 0
    failures: int = 0
    failing: Event | None = None
    """The last `mirror_failed` that no upload has followed (the mirror is behind)."""
    final: Event | None = None
    """The last `mirror_final`: did the newest checkpoint make it at the run's end?"""
    downloaded: Event | None = None
    """The last `mirror_downloaded` (a resume from the mirror)."""

    def add(self, kind: Any, event: Event) -> None:
        if kind in (Kind.MIRROR_UPLOADED, Kind.MIRROR_DOWNLOADED):  # both: the step is there
            step = _int(event.get("step"))
            if step is not None and (self.uploaded_step is None or step > self.uploaded_step):
                self.uploaded_step, self.uploaded_at = step, event.get("time")
        if kind == Kind.MIRROR_UPLOADED:
            self.uploads += 1
            self.failing = None
        elif kind == Kind.MIRROR_FAILED:
            self.failures += 1
            self.failing = event
        elif kind == Kind.MIRROR_FINAL:
            self.final = event
        elif kind == Kind.MIRROR_DOWNLOADED:
            self.downloaded = event


_MIRROR_KINDS = (Kind.MIRROR_UPLOADED, Kind.MIRROR_FAILED, Kind.MIRROR_FINAL,
                 Kind.MIRROR_DOWNLOADED)


@dataclass(kw_only=True)
class Timeline:
    """The run so far, one `add(event)` at a time (the rules are in the module docstring)."""

    keep_curve: bool = False
    launches: int = 0
    first_launch: Event | None = None
    attempts: dict[int, AttemptRecord] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    """Classified failures by kind, over the whole log."""
    level: int | None = None
    settings: dict[str, Any] | None = None
    """The rung in force (None until an event names it)."""
    step: int | None = None
    step_event: Event | None = None
    """The event that named `step`."""
    points: list[Event] = field(default_factory=list)
    """Every `heartbeat_summary`, in order (keep_curve only)."""
    notes: list[Note] = field(default_factory=list)
    """classification, degrade and skipped_checkpoint events, in order (keep_curve only)."""
    mirror: MirrorRecord | None = None
    """Set once the log has a `mirror_*` event."""
    skipped_saves: int = 0
    failure_saves: int = 0
    """Checkpoints a worker committed as an exception ended it (`checkpoint_at_failure`)."""
    last_failure_save: Event | None = None
    run_s: float = 0.0
    """Seconds the run's attempts ran (their `exit.duration_s`)."""
    work_lost: int = 0
    """The run's failures that lost the work since the last save (all but NO_WORK_LOST)."""
    recoveries: list[Event] = field(default_factory=list)
    """Every `recovery` event (what each failure cost), in order: one per relaunch."""
    stragglers: list[Event] = field(default_factory=list)
    """Every `straggler` event (a rank slower than the others), in order."""
    snapshots_persisted: int = 0
    """Memory-tier snapshots rtrain committed to the checkpoint dir (`snapshot_persisted`)."""
    resumes: Counter[str] = field(default_factory=Counter)
    """Launches that resumed, by where the checkpoint was read (`launch.tier`: memory, disk)."""
    _last_skipped: Event | None = None
    _unsaved: str | None = None
    _current: int | None = None  # the attempt named by the newest event that names one
    _last: dict[str, tuple[int, Event]] = field(default_factory=dict)
    _count: int = 0
    _record_start: int = 0  # the count at the last launch of attempt 0

    @property
    def save_cost(self) -> dict[str, float] | None:
        """The save stall and step time of the newest `cadence` event of the current record
        (since the last launch of attempt 0), for the next attempt's first choice."""
        last = self._last.get(Kind.CADENCE)
        if last is None or last[0] < self._record_start:
            return None
        out = {k: last[1].get(k) for k in ("save_stall_s", "step_time_s")}
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                   for v in out.values()) or not out["step_time_s"]:
            return None
        return out

    def add(self, event: Event) -> None:
        kind = event.get("kind")
        self._count += 1
        if isinstance(kind, str):
            self._last[kind] = (self._count, event)
        number = _int(event.get("attempt"))
        if number is not None:
            self._current = number
        record = self.attempts.get(number) if number is not None else None
        if kind == Kind.LAUNCH:
            self.launches += 1
            self.first_launch = self.first_launch or event
            self._unsaved = None
            if number is not None:
                record = self.attempts[number] = AttemptRecord(number=number, launch=event)
            if number == 0:
                self.run_s, self.work_lost = 0.0, 0
                self._record_start = self._count
            if event.get("tier") in ("memory", "disk"):
                self.resumes[event["tier"]] += 1
        elif kind == Kind.CLASSIFICATION:
            self.failures[failure_kind(event)] += 1
            self.work_lost += failure_kind(event) not in NO_WORK_LOST
        elif kind == Kind.EXIT:
            duration = event.get("duration_s")
            if isinstance(duration, (int, float)) and math.isfinite(duration) and duration > 0:
                self.run_s += duration
        elif kind == Kind.RECOVERY:
            self.recoveries.append(event)
        elif kind == Kind.STRAGGLER:
            self.stragglers.append(event)
        elif kind == Kind.SNAPSHOT_PERSISTED:
            self.snapshots_persisted += 1
        elif kind == Kind.SNAPSHOT_RESUMED:
            # The group read memory, whatever its launch's pick was.
            if record is not None and record.launch.get("tier") == "disk":
                self.resumes["disk"] -= 1
            self.resumes["memory"] += 1
        elif kind == Kind.CHECKPOINT_AT_FAILURE:
            self.failure_saves += 1
            self.last_failure_save = event
        elif kind == Kind.SAVE_SKIPPED:
            self.skipped_saves += 1
            self._last_skipped = event
        elif kind == Kind.FINAL_STATE_UNSAVED:
            self._unsaved = str(event.get("reason") or "the final state was not saved")
        elif kind in _MIRROR_KINDS:
            self.mirror = self.mirror or MirrorRecord()
            self.mirror.add(kind, event)
        if kind in _RUNG_KINDS:
            if _int(event.get("level")) is not None:
                self.level = event["level"]
            if isinstance(event.get("settings"), dict):
                self.settings = event["settings"]
        step = (event.get("step") if kind == Kind.HEARTBEAT_SUMMARY
                else event.get("last_step") if kind == Kind.EXIT else None)
        if _int(step) is not None:
            self.step, self.step_event = step, event
        if record is not None:
            self._add_to(record, kind, event, _int(step))
        if self.keep_curve:
            if kind == Kind.HEARTBEAT_SUMMARY:
                self.points.append(event)
            elif kind in (Kind.CLASSIFICATION, Kind.DEGRADE, Kind.SKIPPED_CHECKPOINT):
                current = self.attempts.get(self._current) if self._current is not None else None
                self.notes.append(Note(event=event, attempt=self._current,
                                       step=current.last_step if current else None))

    def _add_to(self, record: AttemptRecord, kind: Any, event: Event, step: int | None) -> None:
        if step is not None:
            record.last_step = step
        if kind == Kind.EXIT:
            record.exit = event
        elif kind == Kind.CLASSIFICATION:
            record.classification = event
        elif kind == Kind.DECISION:
            record.decision = event
        elif kind == Kind.STUCK_RANKS:
            record.stuck = event

    def last(self, *kinds: Kind) -> Event | None:
        """The last event of any of `kinds`."""
        found = [self._last[k.value] for k in kinds if k.value in self._last]
        return max(found, key=lambda pair: pair[0])[1] if found else None

    @property
    def saves(self) -> SkippedSaves:
        last = self._last_skipped
        step = last.get("step") if last is not None else None
        return SkippedSaves(count=self.skipped_saves, last_step=_int(step),
                            last_reason=str(last.get("reason") or "") if last else "",
                            unsaved=self._unsaved)


def read_timeline(path: Path, *, keep_curve: bool = False) -> Timeline:
    """events.jsonl at `path` (missing: empty), read once and folded. EventLogError as
    read_events."""
    timeline = Timeline(keep_curve=keep_curve)
    for event in read_events(path):
        timeline.add(event)
    return timeline
