"""Memory pressure while an attempt runs: readings from each sample, what acting takes on this
run (from the worker's heartbeats), the pure decision (pressure/decide.py), and the relieve
request sent to the child's group.

Host memory is measured against the run's memory cgroup when that has a limit (the limit the
kernel kills at), else against the machine (total minus available); each GPU against its own
memory (NVML). The relieve request is RTRAIN_RELIEVE_SIGNAL (`protocol.RELIEVE_SIGNAL`, SIGURG
by default: ignored by any process that does not handle it, so a plain script or a DataLoader
worker is never hurt by it). The stop for a rung down is the watch's own (proc/watch.py): the
ordinary stop signal, so the worker saves at its next step boundary and exits 75.

The trend starts at the attempt's first step heartbeat: the imports, the model's load and the
restore before it are a climb that stops, not a trend. A child that sends no step heartbeats (a
script without the worker, which could neither relieve nor save at the stop) has the hard line
alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.pressure.decide import (
    Act,
    MemoryReading,
    PressureState,
    Rule,
    Timings,
    advance,
    answered,
)
from rtrain.supervisor.proc.cgroup import MemoryCgroup
from rtrain.supervisor.proc.gpu import GpuReading
from rtrain.supervisor.proc.proctree import TreeSample
from rtrain.supervisor.proc.spawn import Child
from rtrain.supervisor.proc.stop import signal_group

if TYPE_CHECKING:
    from rtrain.supervisor.config import PressureConfig

log = logging.getLogger(__name__)

KEEP = 5  # the measured durations kept; the longest of them counts


@dataclass(frozen=True)
class PressureNote:
    """What the watch did about memory pressure, for the `memory_pressure` event."""

    action: str  # Act value (relieve or degrade), or "rising": make room, nothing asked yet
    reading: MemoryReading
    why: str = ""  # the sentence the decision gave
    left_s: float | None = None  # the trend's time left until the limit, when it decided


def host_reading(group: MemoryCgroup | None, tree: TreeSample,
                 fraction: float) -> MemoryReading:
    """The host side: the cgroup's working set against its limit, else the machine's."""
    limit = group.limit() if group is not None else None
    if limit is not None and limit < tree.host_mem_total:
        used = group.working_set() if group is not None else None
        if used is not None:
            return MemoryReading("cgroup", used, limit, fraction)
    return MemoryReading("host", tree.host_mem_total - tree.host_mem_available,
                         tree.host_mem_total, fraction)


def readings(group: MemoryCgroup | None, tree: TreeSample, gpu: GpuReading,
             config: PressureConfig) -> list[MemoryReading]:
    out = [host_reading(group, tree, config.fraction)]
    out += [MemoryReading(f"gpu{d.index}", d.used, d.total, config.gpu_fraction)
            for d in gpu.devices]
    return out


def rule_of(config: PressureConfig, interval_s: float) -> Rule:
    return Rule(sustain_s=config.sustain_s, trend_s=config.trend_s,
                peak_window_s=config.peak_window_s, trend_from=config.trend_from,
                margin=config.margin, interval_s=interval_s)


class _Durations:
    """Step and save durations from heartbeats (worker clocks, per process)."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.saves: list[float] = []
        self._last_step: dict[int, float] = {}
        self._save_began: dict[int, float] = {}

    def heartbeat(self, hb: Heartbeat) -> None:
        if hb.event == "step":
            before = self._last_step.get(hb.pid)
            self._last_step[hb.pid] = hb.time
            if before is not None and hb.time > before:
                self.steps = [*self.steps, hb.time - before][-KEEP:]
        elif hb.event == "save_begin":
            self._save_began[hb.pid] = hb.time
        elif hb.event == "save_end" and hb.pid in self._save_began:
            self.saves = [*self.saves, max(0.0, hb.time - self._save_began.pop(hb.pid))][-KEEP:]
            self._last_step.pop(hb.pid, None)  # the save is not part of the next step


class PressureWatch:
    """One attempt's pressure: fed each sample and heartbeat, says what the watch must do."""

    def __init__(self, child: Child, config: PressureConfig, group: MemoryCgroup | None,
                 relieve_signal: int, interval_s: float = 1.0) -> None:
        self.child, self.config, self.group = child, config, group
        self.relieve_signal = relieve_signal
        self.rule = rule_of(config, interval_s)
        self.state = PressureState()
        self.host_limit: int | None = None  # the host limit of the newest sample
        self.durations = _Durations()
        self.relieve_s: float | None = None
        self._asked_at: float | None = None
        self._training = False
        self._rose = False  # "rising" was said in this attempt

    @property
    def timings(self) -> Timings:
        d = self.durations
        return Timings(relieve_s=self.relieve_s, step_s=max(d.steps, default=None),
                       save_s=max(d.saves, default=None))

    def heartbeat(self, hb: Heartbeat, now: float) -> None:
        """A heartbeat: the durations acting takes; the first step starts the trend afresh."""
        self.durations.heartbeat(hb)
        if hb.event == "step" and not self._training:
            self._training = True
            self.state = replace(self.state, peaks={})
        if hb.event == "relieved":
            self.answered(now)

    def answered(self, now: float) -> None:
        """The worker relieved what it could: that took this long; the second window starts."""
        if self._asked_at is not None:
            self.relieve_s, self._asked_at = now - self._asked_at, None
        self.state = answered(self.state, now)

    def sample(self, now: float, tree: TreeSample, gpu: GpuReading) -> PressureNote | None:
        """A note when relief was asked or the stop for a rung down is due; None otherwise."""
        found = readings(self.group, tree, gpu, self.config)
        self.host_limit = found[0].limit
        if not self.config.enabled:
            return None
        rule = self.rule if self._training else replace(self.rule, trend_s=0.0)
        self.state, verdict = advance(self.state, found, now, rule, self.timings)
        if verdict.reading is None:
            return None
        if verdict.act is Act.NONE:
            if not verdict.rising or self._rose:
                return None
            self._rose = True
            log.warning("memory pressure rising: %s", verdict.why)
            return PressureNote("rising", verdict.reading, verdict.why, verdict.left_s)
        self._rose = True
        if verdict.act is Act.RELIEVE:
            log.warning("memory pressure: %s; asking the training process to free memory",
                        verdict.why)
            self._asked_at = now
            signal_group(self.child, self.relieve_signal)
        else:
            log.warning("memory pressure: %s; stopping for a rung down", verdict.why)
        return PressureNote(verdict.act.value, verdict.reading, verdict.why, verdict.left_s)
