"""Memory pressure while an attempt runs: readings from each sample, the pure decision
(pressure/decide.py), and the relieve request sent to the child's group.

Host memory is measured against the run's memory cgroup when that has a limit (the limit the
kernel kills at), else against the machine (total minus available); each GPU against its own
memory (NVML). The relieve request is RTRAIN_RELIEVE_SIGNAL (`protocol.RELIEVE_SIGNAL`, SIGURG
by default: ignored by any process that does not handle it, so a plain script or a DataLoader
worker is never hurt by it). The stop for a rung down is the watch's own (proc/watch.py): the
ordinary stop signal, so the worker saves at its next step boundary and exits 75.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.pressure.decide import Act, MemoryReading, PressureState, advance, answered, worst
from supervisor.proc.cgroup import MemoryCgroup
from supervisor.proc.gpu import GpuReading
from supervisor.proc.proctree import TreeSample
from supervisor.proc.spawn import Child
from supervisor.proc.stop import signal_group

if TYPE_CHECKING:
    from supervisor.config import PressureConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PressureNote:
    """What the watch did about memory pressure, for the `memory_pressure` event."""

    action: str  # Act value: relieve or degrade
    reading: MemoryReading


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


class PressureWatch:
    """One attempt's pressure: fed each sample, says what the watch must do."""

    def __init__(self, child: Child, config: PressureConfig, group: MemoryCgroup | None,
                 relieve_signal: int) -> None:
        self.child, self.config, self.group = child, config, group
        self.relieve_signal = relieve_signal
        self.state = PressureState()
        self.host_limit: int | None = None  # the host limit of the newest sample

    def answered(self, now: float) -> None:
        """The worker relieved what it could: the second window starts now."""
        self.state = answered(self.state, now)

    def sample(self, now: float, tree: TreeSample, gpu: GpuReading) -> PressureNote | None:
        """A note when relief was asked or the stop for a rung down is due; None otherwise."""
        found = readings(self.group, tree, gpu, self.config)
        self.host_limit = found[0].limit
        if not self.config.enabled:
            return None
        reading = worst(found)
        self.state, act = advance(self.state, reading, now, self.config.sustain_s)
        if act is Act.NONE or reading is None:
            return None
        if act is Act.RELIEVE:
            log.warning("memory pressure: %s; asking the training process to free memory",
                        reading.describe())
            signal_group(self.child, self.relieve_signal)
        else:
            log.warning("memory pressure persists: %s; stopping for a rung down",
                        reading.describe())
        return PressureNote(act.value, reading)
