"""Who follows the run besides the event log: the metrics file, [[hooks]], the status line and
our own console. Fed by EventLog listeners and polled from the watch's callbacks (samples,
heartbeats), never in the loop's way."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.core import protocol
from rtrain.supervisor.core.event_schema import KINDS, Kind
from rtrain.supervisor.hooks.runner import HookRunner
from rtrain.supervisor.launch.statusline import StatusLine
from rtrain.supervisor.pressure.monitor import PressureNote
from rtrain.supervisor.proc.console import BestEffortWriter
from rtrain.supervisor.proc.watch import Sample
from rtrain.supervisor.records.events import EventLog, EventLogError, read_events
from rtrain.supervisor.records.metrics import MetricsFile
from rtrain.supervisor.straggler.decide import StragglerRule
from rtrain.supervisor.straggler.track import StragglerTracker


class Observers:
    def __init__(self, config: Config, run_dir: Path, ckpt_dir: Path, *, cwd: Path, echo: bool,
                 wall: Callable[[], float], monotonic: Callable[[], float],
                 say: Callable[[str], None]) -> None:
        self.cfg, self.monotonic, self._say = config, monotonic, say
        self.metrics = (MetricsFile(config.metrics_file, run_dir=run_dir, ckpt_dir=ckpt_dir,
                                    wall=wall)
                        if config.metrics_file else None)
        if self.metrics is not None:
            try:
                for event in read_events(run_dir / "events.jsonl"):  # counters continue the run's
                    self.metrics.seed(event)
            except EventLogError:  # an unreadable log: count from this launch on (loop.py says)
                pass
        self.hooks = (HookRunner(config.hooks, cwd=cwd,
                                 env={protocol.ENV_RUN_DIR: str(run_dir.resolve())})
                      if config.hooks else None)
        self.line = StatusLine(sys.stderr) if echo else None
        self.console: list[BestEffortWriter] = []  # our stdout/stderr, when they are real
        self.events: EventLog | None = None
        self.skipped: list[dict[str, Any]] = []  # save_skipped events of this launch
        self._last_summary = float("-inf")
        st = config.straggler
        self._rule = (StragglerRule(factor=st.factor, window_steps=st.window_steps,
                                    min_samples=st.min_samples) if st.enabled else None)
        self.stragglers: StragglerTracker | None = None
        self.straggler_here: str | None = None  # the attempt's last straggler, said

    @property
    def listeners(self) -> list[Callable[[dict[str, Any]], None]]:
        return [o for o in (self.metrics, self.hooks) if o is not None]

    def attach(self, events: EventLog) -> None:
        self.events = events
        if self.hooks is not None:
            self.hooks.report = events.emit

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
        # Each attempt's ranks are compared afresh (a relaunch may run on other nodes).
        self.stragglers = StragglerTracker(self._rule) if self._rule is not None else None
        self.straggler_here = None

    def tick(self, hb: protocol.Heartbeat | None = None) -> None:
        """Watch ticks for the observers: metrics ages, hooks past their deadline."""
        if self.metrics is not None:
            if hb is not None:
                self.metrics.heartbeat(hb.step)
            else:
                self.metrics.tick()
        if self.hooks is not None:
            self.hooks.poll()

    def sample(self, sample: Sample) -> None:
        self.tick()
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
        self.tick(hb)
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
        if hb.event in ("compile_cache_loaded", "compile_cache_ignored"):
            self.events.emit(Kind.COMPILE_CACHE, attempt=attempt, rank=hb.rank,
                             outcome=hb.event.rpartition("_")[2], detail=hb.reason)
        if hb.event == "saved_at_failure":
            self.events.emit("checkpoint_at_failure", attempt=attempt, step=hb.step,
                             rank=hb.rank, exception=hb.reason)
            self.say(f"checkpoint at step {hb.step} saved as the worker failed ({hb.reason})")
        if self.stragglers is not None:
            self._stragglers(attempt, hb)
        if self.line is not None and hb.step is not None:
            self.line.update(step=hb.step, loss=hb.loss, samples_per_s=hb.samples_per_s,
                             next_save_step=hb.next_save_step)
        now = self.monotonic()
        if hb.event == "step" and now - self._last_summary >= self.cfg.summary_every_s:
            self._last_summary = now
            self.events.emit("heartbeat_summary", attempt=attempt, step=hb.step, loss=hb.loss,
                             samples_per_s=hb.samples_per_s)

    def _stragglers(self, attempt: int, hb: protocol.Heartbeat) -> None:
        assert self.events is not None and self.stragglers is not None
        for found in self.stragglers.heartbeat(hb):
            s = found.straggler
            where = f" on {found.host}" if found.host else ""
            detail = s.describe() + where
            self.events.emit(Kind.STRAGGLER, attempt=attempt, step=s.step, rank=s.rank,
                             host=found.host, ratio=round(s.ratio, 3),
                             busy_s=round(s.busy_s, 6), others_busy_s=round(s.others_busy_s, 6),
                             ranks=found.ranks, window_steps=self.stragglers.rule.window_steps,
                             detail=detail)
            self.say(f"straggler: {detail}")
            self.straggler_here = detail

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
        if self.hooks is not None:
            self.hooks.close()  # a give-up alert runs to its deadline
        if self.metrics is not None:
            self.metrics.stopped()
