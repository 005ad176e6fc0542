"""Named failure kinds (contract 2), and a `Failure`: its kind, its sentence, what it rests on."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from rtrain.supervisor.decide.observation import Observation


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
class Failure:
    kind: FailureKind
    reason: str  # the sentence the user reads
    exit_code: int | None = None
    signal: str | None = None
    seen: Observation | None = None  # what the classification rests on
