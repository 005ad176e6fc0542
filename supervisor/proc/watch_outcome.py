"""What a watched attempt returns (`Outcome`), and what the child leaves behind once it has
exited: exit status, stderr tail, exit records, memory, the devices' health checks.

The watch (proc/watch.py) keeps what it sees while the child runs to itself and, once the child
has exited, adds these and hands out one frozen `Observation` (decide/observation.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.protocol import ExitRecord
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.proc.cgroup import MemoryCgroup, memory_cgroup
from rtrain.supervisor.proc.gpu import GpuReader
from rtrain.supervisor.proc.gpu_health import DeviceHealth, problems
from rtrain.supervisor.proc.spawn import Child
from rtrain.supervisor.proc.stop import StopResult

log = logging.getLogger(__name__)

EXIT_RECORD_MAX = 1 << 20  # bytes: a record with its traceback tail is a few KiB


@dataclass(frozen=True)
class Outcome:
    """What `watch` returns: what it saw (for the decision and the records), and the process
    side of the ending (for the loop and its GPU wait)."""

    seen: Observation
    stop: StopResult  # escalation and sweep: what was killed, what is left
    hard_stop: bool = False  # a second SIGINT: SIGKILL at once, no grace
    pids_seen: list[int] = field(default_factory=list)  # for wait_gpu_released
    stack_files: list[Path] = field(default_factory=list)


@dataclass(frozen=True)
class OomCounter:
    """The memory cgroup's OOM-kill counter, read when the attempt starts and when it ends."""

    group: MemoryCgroup | None
    base: int | None

    @classmethod
    def start(cls, child: Child) -> OomCounter:
        spec_dir = child.spec.cgroup_dir
        if spec_dir is not None:
            group = MemoryCgroup(spec_dir, 1 if (spec_dir / "memory.oom_control").exists() else 2)
        else:  # a fast-dying child is already gone: it was in ours
            group = memory_cgroup(child.pid) or memory_cgroup(os.getpid())
        return cls(group, group.oom_kills() if group else None)

    def since_start(self) -> int | None:
        """OOM kills in the group since `start`; None without a readable counter."""
        if self.group is None or self.base is None:
            return None
        return max(0, (self.group.oom_kills() or self.base) - self.base)


def health_gate(gpu: GpuReader) -> tuple[DeviceHealth, ...]:
    """After a failed attempt, NVML's device checks (reachable, retired pages, row
    remapping, fatal XIDs, the driver's recovery action): the readings of the devices that fail
    them, which make the failure `lost_device`."""
    if not gpu.available:
        return ()
    return tuple(h for h in gpu.health() if problems(h))


def read_exit_records(attempt_dir: Path) -> list[dict]:
    """Exit records the ranks wrote (contract 2), ordered by rank; unreadable ones are skipped."""
    records = []
    for path in attempt_dir.glob("exit-rank*.json"):
        try:  # never through a link or blocking on a FIFO planted at the name
            record = ExitRecord.from_json(ownfiles.read_own(path, limit=EXIT_RECORD_MAX))
        except OSError as e:
            if isinstance(e, ownfiles.RefusedFile):
                log.warning("exit record not read: %s", e)
            continue
        if record is not None:
            if record.time is None:  # older workers: the file's own time orders it
                record.time = path.stat().st_mtime
            records.append(asdict(record))
    return sorted(records, key=lambda r: r["rank"])


def host_total() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
