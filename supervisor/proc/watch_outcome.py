"""What a watched attempt returns: the `Outcome`, and the part of its `Evidence` known only
once the child has exited (exit status, stderr tail, exit records, memory, the health gate).

The watch (proc/watch.py) fills in what it sees while the child runs and calls `record_exit`
and `health_gate` once it has exited; these two modules are the only writers of an attempt's
Evidence, and everyone after them only reads.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from supervisor import ownfiles
from supervisor.decide.classify import plain_script_started
from supervisor.decide.failures import Evidence
from supervisor.proc.cgroup import MemoryCgroup, memory_cgroup
from supervisor.proc.gpu import GpuReader
from supervisor.proc.gpu_health import DeviceHealth, describe, problems
from supervisor.proc.proctree import ProcTree
from supervisor.proc.spawn import Child
from supervisor.proc.stop import StopResult
from supervisor.protocol import ExitRecord, Heartbeat

log = logging.getLogger(__name__)

EXIT_RECORD_MAX = 1 << 20  # bytes: a record with its traceback tail is a few KiB


@dataclass
class HeartbeatSummary:
    count: int = 0
    last_event: str | None = None
    last_step: int | None = None
    last_loss: float | None = None
    samples_per_s: float | None = None
    max_step_interval: float | None = None
    settings: dict | None = None  # as last reported by the worker
    longest_save_s: float | None = None  # save_begin to save_end, by the worker's clock
    exception_at: float | None = None  # the first `exception` heartbeat's time (worker's clock)
    _save_began: dict[int, float] = field(default_factory=dict)  # rank -> its save_begin

    def add(self, hb: Heartbeat) -> None:
        self.count += 1
        self.last_event = hb.event
        if hb.event == "save_begin":
            self._save_began[hb.rank] = hb.time
        elif hb.event == "save_end" and hb.rank in self._save_began:
            took = max(0.0, hb.time - self._save_began.pop(hb.rank))
            self.longest_save_s = max(took, self.longest_save_s or 0.0)
        elif hb.event == "exception" and self.exception_at is None:
            self.exception_at = hb.time
        if hb.step is not None:
            self.last_step = hb.step
        for name in ("loss", "samples_per_s", "max_step_interval", "settings"):
            value = getattr(hb, name)
            if value is not None:
                setattr(self, "last_loss" if name == "loss" else name, value)


@dataclass
class Outcome:
    evidence: Evidence
    heartbeats: HeartbeatSummary
    stop: StopResult  # escalation and sweep: what was killed, what is left
    signals: list[str] = field(default_factory=list)  # signals that reached the supervisor
    hard_stop: bool = False  # a second SIGINT: SIGKILL at once, no grace
    pids_seen: list[int] = field(default_factory=list)  # for wait_gpu_released
    stack_files: list[Path] = field(default_factory=list)
    failed_devices: tuple[DeviceHealth, ...] = ()  # the health gate's failed readings
    stop_s: float | None = None  # from the stop signal to the child's exit, when stopped
    exited_at: float | None = None  # unix time the watch saw the child end


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


def record_exit(ev: Evidence, *, child: Child, tree: ProcTree, oom: OomCounter,
                summary: HeartbeatSummary, killed_after_grace: bool, duration_s: float) -> None:
    """Fill in what the exited (and reaped) child leaves behind."""
    rc = child.returncode
    if rc is not None and rc < 0:
        ev.signal = signal.Signals(-rc).name
    else:
        ev.returncode = rc
    ev.stderr_tail = child.stderr.tail_text()
    ev.exit_records = read_exit_records(child.spec.attempt_dir)
    ev.peak_rss_bytes = tree.peak_rss
    ev.host_mem_available_min = tree.min_available
    ev.host_mem_total = _host_total()
    kills = oom.since_start()
    if kills is not None:
        ev.cgroup_oom_kills = kills
    ev.killed_after_grace = killed_after_grace
    ev.duration_s = duration_s
    ev.stop_confirmed = summary.last_event == "stop"
    if summary.count == 0 or summary.last_step is None:
        # No step heartbeats: a plain script, or one that died before its first step.
        ev.first_step_seen = summary.count == 0 and plain_script_started(ev)


def health_gate(gpu: GpuReader, ev: Evidence) -> tuple[DeviceHealth, ...]:
    """After a failed attempt, NVML's device checks (reachable, retired pages, row
    remapping, fatal XIDs, the driver's recovery action): a device that fails them makes the
    failure `lost_device`, with the readings as evidence."""
    if not gpu.available:
        return ()
    failed = tuple(h for h in gpu.health() if problems(h))
    if failed:
        ev.gpu_lost = True
        found = describe(list(failed))
        ev.gpu_detail = "; ".join(filter(None, [ev.gpu_detail, found]))
    return failed


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


def _host_total() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
