"""What the terminal shows of the run (the status line, our own console) and the events the
workers' heartbeats make (a skipped save, the cadence chosen, a relief, a refused request, a save
at a failure, the periodic summary). Fed from the watch's callbacks, never in the loop's way; the
optional followers (metrics, hooks, stragglers) are features (launch/feature.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrain.supervisor.core import protocol
from rtrain.supervisor.core.event_schema import KINDS, Kind
from rtrain.supervisor.launch.statusline import StatusLine
from rtrain.supervisor.pressure.monitor import PressureNote
from rtrain.supervisor.proc.console import BestEffortWriter
from rtrain.supervisor.proc.watch import Sample
from rtrain.supervisor.records.events import EventLog


class Observers:
    def __init__(self, *, echo: bool, summary_every_s: float, monotonic: Callable[[], float],
                 say: Callable[[str], None]) -> None:
        self.summary_every_s, self.monotonic, self._say = summary_every_s, monotonic, say
        self.line = StatusLine(sys.stderr) if echo else None
        self.console: list[BestEffortWriter] = []  # our stdout/stderr, when they are real
        self.events: EventLog | None = None
        self.skipped: list[dict[str, Any]] = []  # save_skipped events of this launch
        self._last_summary = float("-inf")

    def attach(self, events: EventLog) -> None:
        self.events = events

    def say(self, text: str) -> None:
        if self.line is None:
            self._say(text)
            return
        with self.line.suspend():
            self._say(text)

    def attempt_started(self, attempt: int, attempt_dir: Path, level: int) -> None:
        for out in self.console:
            out.hint = f"{attempt_dir}/"
        if self.line is not None:
            self.line.update(attempt=attempt, level=level, step=None, loss=None,
                             samples_per_s=None)
        self._last_summary = float("-inf")  # each attempt's first step starts its curve

    def sample(self, sample: Sample) -> None:
        for out in self.console:  # echo held back while the console was slow
            out.try_flush()
        if self.line is None:
            return
        devices = sample.gpu.devices
        used = sum(d.used for d in devices) if devices else None
        total = sum(d.total for d in devices) if devices else None
        self.line.update(rss_bytes=sample.tree.rss_bytes, gpu_used=used, gpu_total=total)

    def heartbeat(self, attempt: int, hb: protocol.Heartbeat) -> None:
        assert self.events is not None
        if hb.event == "save_skipped":
            self.skipped.append(self.events.emit("save_skipped", attempt=attempt, step=hb.step,
                                                 rank=hb.rank, reason=hb.reason))
            self.say(f"checkpoint at step {hb.step} not saved: {hb.reason}")
        if hb.event == "cadence" and hb.rank == 0 and isinstance(hb.cadence, dict):
            # Rank 0's choice stands for the run (each rank chooses alike from its own timing).
            known = KINDS[Kind.CADENCE].fields
            self.events.emit(Kind.CADENCE, attempt=attempt, step=hb.step,
                             **{k: hb.cadence.get(k) for k in known if k not in ("attempt",
                                                                                "step")})
        if hb.event == "relieved":
            self.events.emit("pressure_relieved", attempt=attempt, step=hb.step, rank=hb.rank,
                             detail=hb.reason, settings=hb.settings)
        if hb.event == "control_refused":
            self.events.emit("control_refused", attempt=attempt, rank=hb.rank, reason=hb.reason)
            self.say(f"the training process refused requests rtrain did not make: {hb.reason}")
        if hb.event == "saved_at_failure":
            self.events.emit("checkpoint_at_failure", attempt=attempt, step=hb.step,
                             rank=hb.rank, exception=hb.reason)
            self.say(f"checkpoint at step {hb.step} saved as the worker failed ({hb.reason})")
        if self.line is not None and hb.step is not None:
            self.line.update(step=hb.step, loss=hb.loss, samples_per_s=hb.samples_per_s,
                             next_save_step=hb.next_save_step)
        now = self.monotonic()
        if hb.event == "step" and now - self._last_summary >= self.summary_every_s:
            self._last_summary = now
            self.events.emit("heartbeat_summary", attempt=attempt, step=hb.step, loss=hb.loss,
                             samples_per_s=hb.samples_per_s)

    def heartbeats_refused(self, attempt: int, refused: dict[str, int]) -> None:
        """Datagrams on the heartbeat socket from processes that are not the attempt's
        (proc/senders.py): refused, said once per attempt."""
        if not refused:
            return
        assert self.events is not None
        count = sum(refused.values())
        senders = sorted(refused)
        self.events.emit("heartbeats_refused", attempt=attempt, count=count, senders=senders)
        self.say(f"attempt {attempt}: refused {count} heartbeat{'s' * (count != 1)} from "
                 f"processes that are not the attempt's: {', '.join(senders)[:300]}")

    def pressure(self, attempt: int, note: PressureNote) -> None:
        """The watch asked for relief, or stops the child for a rung down."""
        assert self.events is not None
        r = note.reading
        self.events.emit("memory_pressure", attempt=attempt, action=note.action,
                         source=r.source, used=r.used, limit=r.limit, fraction=r.fraction,
                         why=note.why, left_s=note.left_s)
        what = ("asking the training process to free memory" if note.action == "relieve"
                else "stopping the attempt at its next step to go one rung down")
        self.say(f"memory pressure: {note.why or r.describe()}; {what}")

    def close(self) -> None:
        if self.line is not None:
            self.line.clear()
