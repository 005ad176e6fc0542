"""Named failure kinds (contract 2) and the evidence a classification rests on."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class FailureKind(str, enum.Enum):
    OOM_GPU = "oom_gpu"
    OOM_HOST = "oom_host"  # the kernel OOM killer (or a cgroup limit) killed the child
    PREEMPTED = "preempted"  # stopped on request, checkpoint committed (exit 75)
    HANG = "hang"
    NONFINITE = "nonfinite"  # loss/grad NaN/Inf persisting
    STARTUP = "startup"  # failed before its first step: never retried in a loop
    DATA = "data"  # too many bad samples
    CRASH = "crash"  # anything else
    LOST_DEVICE = "lost_device"  # NVML reports the GPU gone / Xid
    BAD_CHECKPOINT = "bad_checkpoint"  # the worker could not load the checkpoint it was given
    # rtrain stopped the child under sustained memory pressure, before an OOM (it saved)
    MEMORY_PRESSURE = "memory_pressure"


# The kinds the degradation ladder answers, and that share the "oom" restart budget: a stop for
# memory pressure is one more ladder step, so the budget still bounds how far the ladder goes.
OUT_OF_MEMORY = (FailureKind.OOM_GPU, FailureKind.OOM_HOST, FailureKind.MEMORY_PRESSURE)


@dataclass(frozen=True)
class Evidence:
    """What classification reads of one attempt, and only this: drawn once from what the watch
    saw (decide/observation.py `evidence`), never changed after."""

    returncode: int | None = None  # None while running / when killed by a signal
    pid: int | None = None  # the child's pid, named in the reason sentence
    signal: str | None = None  # e.g. "SIGKILL" when the child died of a signal
    exit_records: tuple[dict[str, Any], ...] = ()  # ExitRecord dicts, by rank
    stderr_tail: str = ""
    first_step_seen: bool = False  # a heartbeat with a step, or (plain scripts) see `progress`
    last_step: int | None = None
    peak_rss_bytes: int = 0  # process tree
    host_mem_available_min: int | None = None  # lowest MemAvailable seen
    host_mem_total: int | None = None
    cgroup_oom_kills: int = 0  # increase of the oom_kill counter during the attempt
    host_mem_limit: int | None = None  # what host pressure is measured against: cgroup or machine
    gpu_mem_used_peak: int | None = None
    gpu_mem_total: int | None = None
    pressure_stop: str | None = None  # why rtrain stopped the child under memory pressure
    gpu_lost: bool = False
    gpu_detail: str = ""
    hang: bool = False  # the watcher stopped it for silence
    hang_detail: str = ""
    hang_at: float | None = None  # unix time the hang was detected (before stacks are dumped)
    stuck_summary: str = ""  # which rank is stuck and where (stuck/decide.py), at a hang
    # the signal name that reached the supervisor, or the deadline's name ("the job's time
    # limit": the watch's stop_at), if any
    stop_requested: str | None = None
    stop_confirmed: bool = False  # the worker said "checkpoint committed, stopping" (heartbeat)
    killed_after_grace: bool = False
    duration_s: float = 0.0

    def __post_init__(self) -> None:
        # A list given (a table test's) is kept as a tuple: the evidence does not change.
        object.__setattr__(self, "exit_records", tuple(self.exit_records))


@dataclass(frozen=True)
class Failure:
    kind: FailureKind
    reason: str  # the sentence the user reads
    exit_code: int | None = None
    signal: str | None = None
    evidence: Evidence | None = None
