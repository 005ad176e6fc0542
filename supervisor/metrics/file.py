"""`--metrics-file PATH`: the run's vital signs in Prometheus text format.

For node-exporter's textfile collector (or anything that scrapes a file): the file is written to
a temp file in the same directory and renamed over PATH, so a reader never sees a partial file.
It is rewritten at each event (an EventLog listener) and, from the watch callbacks, at most every
`every_s` seconds so that the ages keep moving while nothing happens. Each write is one small
file: no fsync (a lost write is replaced seconds later).

    rtrain_up{run_dir}                             1 while rtrain supervises, 0 once it stopped
    rtrain_attempts_total{run_dir}                 attempts launched
    rtrain_failures_total{run_dir,kind}            classified failures by kind
    rtrain_rung{run_dir}                           degradation ladder rung in force (0: none)
    rtrain_last_step{run_dir}                      newest step reported
    rtrain_seconds_since_heartbeat{run_dir}        since the last heartbeat from the child
    rtrain_last_checkpoint_age_seconds{run_dir}    since the newest checkpoint's commit
    rtrain_skipped_saves_total{run_dir}            checkpoints the worker could not write
    rtrain_failure_saves_total{run_dir}            checkpoints committed as an exception ended it
    rtrain_failure_seconds_lost_total{run_dir,kind} what failures cost (recovery events' lost_s)
    rtrain_last_recovery_seconds{run_dir,phase}    the last recovery's phases, and its total
    rtrain_stragglers_total{run_dir}               ranks found slower than the others
    rtrain_straggler_ratio{run_dir,rank,host}      the newest attempt's stragglers: how many
                                                   times slower than the other ranks
    rtrain_memory_tier_every_steps{run_dir}        the memory tier's interval (0: off, dropped)
    rtrain_snapshots_persisted_total{run_dir}      memory-tier snapshots rtrain committed to disk
    rtrain_resumes_total{run_dir,tier}             relaunches by where the checkpoint was read
    rtrain_mirror_uploaded_step{run_dir}           newest checkpoint step on the mirror
    rtrain_mirror_lag_steps{run_dir}               newest local checkpoint's step minus that
    rtrain_mirror_seconds_since_upload{run_dir}    since the last upload finished
    rtrain_mirror_failures_total{run_dir}          failed uploads, listings and downloads

The mirror's series appear once the log has a mirror event (runs with `--mirror`); the memory
tier's once it has a `memory_tier` event (`Saving(memory=...)`).

A value not known yet (no heartbeat, no checkpoint) is left out rather than invented.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import manifest
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.supervisor.core.atomic_write import write_atomic
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.records import recovery
from rtrain.supervisor.records.timeline import Timeline

log = logging.getLogger(__name__)

_HELP = {
    "rtrain_up": ("gauge", "1 while rtrain supervises the run, 0 once it stopped"),
    "rtrain_attempts_total": ("counter", "Training attempts launched"),
    "rtrain_failures_total": ("counter", "Attempts that ended in a failure, by kind"),
    "rtrain_rung": ("gauge", "Degradation ladder rung in force (0: the configured settings)"),
    "rtrain_last_step": ("gauge", "Newest training step reported by the child"),
    "rtrain_seconds_since_heartbeat": ("gauge", "Seconds since the child's last heartbeat"),
    "rtrain_last_checkpoint_age_seconds": ("gauge",
                                           "Seconds since the newest checkpoint was committed"),
    "rtrain_failure_saves_total": ("counter",
                                   "Checkpoints the worker committed as an exception ended it"),
    "rtrain_skipped_saves_total": ("counter",
                                   "Checkpoints not written (full disk, storage errors)"),
    "rtrain_failure_seconds_lost_total": (
        "counter", "Seconds failures cost, by kind: failure to first resumed step, plus the "
                   "steps run again"),
    "rtrain_last_recovery_seconds": ("gauge",
                                     "The last relaunched failure's cost, phase by phase"),
    "rtrain_stragglers_total": ("counter", "Ranks found consistently slower than the others"),
    "rtrain_straggler_ratio": ("gauge", "The newest attempt's stragglers: busy time per step "
                                        "over the other ranks' median"),
    "rtrain_memory_tier_every_steps": ("gauge", "Steps between memory-tier snapshots (0: the "
                                                "tier is off or was dropped)"),
    "rtrain_snapshots_persisted_total": ("counter", "Memory-tier snapshots rtrain committed to "
                                                    "the checkpoint dir"),
    "rtrain_resumes_total": ("counter", "Relaunches that resumed, by where the checkpoint was "
                                        "read (memory, disk)"),
    "rtrain_mirror_uploaded_step": ("gauge", "Step of the newest checkpoint on the mirror"),
    "rtrain_mirror_lag_steps": ("gauge",
                                "Newest local checkpoint's step minus the newest on the mirror"),
    "rtrain_mirror_seconds_since_upload": ("gauge",
                                           "Seconds since the last upload to the mirror"),
    "rtrain_mirror_failures_total": ("counter",
                                     "Failed mirror uploads, listings and downloads"),
}


def escape_label(value: str) -> str:
    """A label value in the text format: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class MetricsFile:
    """Keeps the run's numbers and writes them to `path`; an EventLog listener."""

    path: Path
    run_dir: Path
    ckpt_dir: Path
    every_s: float = 5.0
    """Least interval between writes driven by `tick()` (events always write)."""
    wall: Callable[[], float] = time.time
    up: bool = True
    timeline: Timeline = field(default_factory=Timeline)
    """The run's events so far: attempts, failures, rung, skipped saves."""
    last_step: int | None = None
    last_heartbeat: float | None = None
    """Unix time of the last heartbeat (from the child, or a heartbeat_summary event)."""
    _written: float = float("-inf")
    _ckpt_seen: tuple[int, float] | None = None  # (step, created) of the newest checkpoint

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.run_dir = Path(self.run_dir).resolve()

    def __call__(self, event: dict[str, Any]) -> None:
        self.seed(event)
        self.write()

    def seed(self, event: dict[str, Any]) -> None:
        """Take in one event without writing (the run's earlier events, at start-up)."""
        self.timeline.add(event)
        kind = event.get("kind")
        if kind == Kind.LAUNCH:
            self.up = True
        elif kind == Kind.HEARTBEAT_SUMMARY:
            self.last_heartbeat = float(event.get("time") or self.wall())
        if self.timeline.step_event is event:  # live heartbeats also move last_step
            self.last_step = self.timeline.step

    def heartbeat(self, step: int | None) -> None:
        """A heartbeat arrived from the child (watch callback); writes if due."""
        self.last_heartbeat = self.wall()
        if step is not None:
            self.last_step = step
        self.tick()

    def tick(self) -> None:
        """Write if the last write is `every_s` old (watch callbacks call this often)."""
        if self.wall() - self._written >= self.every_s:
            self.write()

    def stopped(self) -> None:
        """rtrain is about to exit: rtrain_up 0, final write."""
        self.up = False
        self.write()

    def _newest_checkpoint(self) -> tuple[int, float] | None:
        """(step, created) of the newest checkpoint whose manifest reads."""
        # One scandir per write; the newest manifest is read again only when a newer step shows.
        for step, path in list_checkpoints(self.ckpt_dir):
            if self._ckpt_seen is not None and self._ckpt_seen[0] == step:
                return self._ckpt_seen
            try:
                # manifest.load: never blocks on a FIFO, never parses a bomb.
                created = manifest.load(path)["created"]
            except manifest.ManifestError:
                continue  # being written, or damaged: the next older one counts
            if isinstance(created, (int, float)) and math.isfinite(created):
                self._ckpt_seen = (step, float(created))
                return self._ckpt_seen
        return None

    def render(self) -> str:
        now = self.wall()
        run = f'run_dir="{escape_label(str(self.run_dir))}"'
        values: dict[str, list[tuple[str, float]]] = {
            "rtrain_up": [(run, 1 if self.up else 0)],
            "rtrain_attempts_total": [(run, self.timeline.launches)],
            "rtrain_failures_total": [(f'{run},kind="{escape_label(k)}"', n)
                                      for k, n in sorted(self.timeline.failures.items())],
            "rtrain_rung": [(run, self.timeline.level or 0)],
            "rtrain_last_step": [(run, self.last_step)] if self.last_step is not None else [],
            "rtrain_seconds_since_heartbeat": (
                [(run, round(max(0.0, now - self.last_heartbeat), 3))]
                if self.last_heartbeat is not None else []),
        }
        newest = self._newest_checkpoint()
        values["rtrain_last_checkpoint_age_seconds"] = (
            [(run, round(max(0.0, now - newest[1]), 3))] if newest is not None else [])
        values["rtrain_skipped_saves_total"] = [(run, self.timeline.skipped_saves)]
        values["rtrain_failure_saves_total"] = [(run, self.timeline.failure_saves)]
        if self.timeline.recoveries:
            values["rtrain_failure_seconds_lost_total"] = [
                (f'{run},kind="{escape_label(c.kind)}"', round(c.lost_s, 3))
                for c in sorted(recovery.costs_by_kind(self.timeline.recoveries),
                                key=lambda c: c.kind)]
            last = self.timeline.recoveries[-1]
            values["rtrain_last_recovery_seconds"] = [
                (f'{run},phase="{p}"', last[f"{p}_s"]) for p in (*recovery.PHASES, "total")
                if isinstance(last.get(f"{p}_s"), (int, float))]
        values["rtrain_stragglers_total"] = [(run, len(self.timeline.stragglers))]
        launch = self.timeline.last(Kind.LAUNCH)
        values["rtrain_straggler_ratio"] = [
            (f'{run},rank="{e.get("rank")}",host="{escape_label(str(e.get("host") or ""))}"',
             e["ratio"]) for e in self.timeline.stragglers
            if launch is not None and e.get("attempt") == launch.get("attempt")
            and isinstance(e.get("ratio"), (int, float)) and math.isfinite(e["ratio"])]
        if (tier := self.timeline.last(Kind.MEMORY_TIER)) is not None:
            every = tier.get("every") if tier.get("state") == "on" else 0
            values["rtrain_memory_tier_every_steps"] = (
                [(run, every)] if isinstance(every, int) else [])
            values["rtrain_snapshots_persisted_total"] = [(run,
                                                           self.timeline.snapshots_persisted)]
            values["rtrain_resumes_total"] = [(f'{run},tier="{t}"', n) for t, n in
                                              sorted(self.timeline.resumes.items())]
        if (m := self.timeline.mirror) is not None:
            up = m.uploaded_step
            values["rtrain_mirror_uploaded_step"] = [(run, up)] if up is not None else []
            values["rtrain_mirror_lag_steps"] = (
                [(run, max(0, newest[0] - (up if up is not None else 0)))]
                if newest is not None and (up is not None or m.failures) else [])
            at = m.uploaded_at
            values["rtrain_mirror_seconds_since_upload"] = (
                [(run, round(max(0.0, now - at), 3))] if isinstance(at, (int, float)) else [])
            values["rtrain_mirror_failures_total"] = [(run, m.failures)]
        lines = []
        for name, samples in values.items():
            kind, text = _HELP[name]
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {_number(v)}" for labels, v in samples]
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        """Temp file in the same directory, then rename over the target: never a partial file."""
        self._written = self.wall()
        try:  # 0644: a collector may run as another user; rewritten often, so not fsynced
            write_atomic(self.path, self.render(), mode=0o644, durable=False)
        except OSError as err:  # a full or read-only disk must not stop supervision
            log.warning("cannot write metrics file %s: %s", self.path, err)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
