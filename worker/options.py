"""The Checkpointer's option groups: when to save, what to keep, how to save, how to restore,
and the memory tier.

Each group is a frozen dataclass with defaults, so the common case passes none of them and a
script that changes one setting names only that one: `saving=Saving(async_mode="fork")`. The
groups check their own values when built, so a mistake fails at the line that made it. Each
class's "Attributes:" section is the reference for its fields: `help(rtrain.Checkpointer)`
shows them all (worker/checkpointer.py appends them) and docs/reference.md is generated
from that text (scripts/gen_reference.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rtrain.checkpoint.verify import Level
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.worker.saving.cadence import MAX_SECONDS, CadenceBounds

if TYPE_CHECKING:
    import torch

AsyncMode = Literal["off", "auto", "fork", "thread"]
FAILURE_SAVE_TIMEOUT_S = 300.0  # the longest a failing process waits for its save at the failure


@dataclass(frozen=True, kw_only=True)
class Every:
    """When to save. `every=100` is `Every(steps=100)`; `every="auto"` is `Every(steps="auto")`.

    Attributes:
        steps: Save when the step is a multiple of this. "auto" re-chooses the interval after
            every save from the measured save stall, the step time, the run's failures (passed
            in by rtrain) and the loss trend, within `min_steps`..`max_steps`; until a save is
            measured it saves at step 2 to measure one (worker/saving/cadence.py).
            None: no step schedule.
        seconds: Save when this much wall time has passed since the last save. With
            steps="auto" it is the longest time between saves (default 1800).
        epoch_end: Also save when `maybe_save(..., epoch_end=True)` is called.
        min_steps: steps="auto" only: never save more often than every this many steps.
        max_steps: steps="auto" only: never save less often than every this many steps
            (None: no step limit).
    """

    steps: int | Literal["auto"] | None = None
    seconds: float | None = None
    epoch_end: bool = False
    min_steps: int = 1
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.steps != "auto":
            if self.steps is not None and (not _is_int(self.steps) or self.steps < 1):
                raise ValueError(f"Every(steps=) takes a whole number of at least 1 or 'auto', "
                                 f"not {self.steps!r}")
            if self.min_steps != 1 or self.max_steps is not None:
                raise ValueError("Every(min_steps=, max_steps=) bound steps='auto': set "
                                 "steps='auto' or leave them out")
        if self.seconds is not None and not self.seconds > 0:
            raise ValueError(f"Every(seconds=) must be positive, not {self.seconds!r}")
        if self.steps == "auto":
            self.bounds()  # CadenceBounds checks min_steps and max_steps

    def bounds(self) -> CadenceBounds | None:
        """The limits of an automatic cadence (None: a fixed schedule)."""
        if self.steps != "auto":
            return None
        seconds = self.seconds if self.seconds is not None else MAX_SECONDS
        return CadenceBounds(min_steps=self.min_steps, max_steps=self.max_steps,
                             max_seconds=seconds)


@dataclass(frozen=True, kw_only=True)
class Keep:
    """Which checkpoints to keep when a new one is committed. `keep=3` is `Keep(last=3)`;
    `keep=None` keeps every checkpoint.

    Attributes:
        last: The newest verified checkpoints to keep (at least 1); None keeps all.
        best: Also keep this many best checkpoints by `metric`.
        metric: The name (a key of `maybe_save(metrics=...)`) that ranks checkpoints for
            `best`.
        mode: "min" when lower is better (a loss), "max" when higher is (an accuracy).
        milestone_every: Also keep every checkpoint whose step is a multiple of this (0: none).
    """

    last: int | None = 3
    best: int = 0
    metric: str | None = None
    mode: Literal["min", "max"] = "min"
    milestone_every: int = 0

    def __post_init__(self) -> None:
        self.policy()  # RetentionPolicy checks the values

    def policy(self) -> RetentionPolicy:
        """The same rule in the checkpoint format's terms (`rtrain prune` applies it too)."""
        return RetentionPolicy(keep=self.last, keep_best=self.best, metric=self.metric,
                               mode=self.mode, milestone_every=self.milestone_every)


@dataclass(frozen=True, kw_only=True)
class Saving:
    """How a checkpoint is written.

    Attributes:
        async_mode: "off" writes in the training thread. "fork" forks a writer whose
            copy-on-write view of memory is the snapshot (the stall is the fork); "thread"
            copies tensors into reused pinned buffers and writes them from a thread; "auto"
            forks for state in host memory and uses the thread for CUDA state or under
            torch.distributed (a forked child cannot join collectives). Sharded (DCP) state is
            always written synchronously.
        fsync: fsync every file and directory before the commit, so a power loss cannot leave
            a committed checkpoint unreadable. False only where the storage makes it moot.
        sharded: True saves DTensor/FSDP state through torch.distributed.checkpoint, each
            rank its own shards; False saves the model's state dict as one replicated copy;
            None detects sharded parameters at each save.
        trainable_only: Save only the parameters that require grad (adapters), with a
            fingerprint of the frozen base that the restore checks. Not with sharded state.
        on_failure: When an exception ends the script before anything changed the training
            state since the last step boundary, commit that step's checkpoint (single
            process; worker/saving/failsave.py).
        failure_timeout_s: The longest the failing process waits for that save.
        memory: Also snapshot into shared memory between disk saves (the memory tier): a
            number of steps, "auto", or a Memory (below). None or 0: off. Left out, the tier
            is on under `rtrain launch` for a single process wherever the state fits (twice
            in the budget and in /dev/shm) at the interval "auto" chooses, said once with its
            cost; off, with one line saying why, where it does not fit. Left out or named,
            scheduled disk saves are then snapshots rtrain copies to disk in the background;
            a stop, `save()` and `request_save()` stay direct writes from this process.
        compile_cache: Also save torch.compile's portable cache artifacts beside each
            checkpoint (`compile-cache.bin`, torch.compiler.save_cache_artifacts), so a
            relaunch on a fresh node compiles warm. Loaded at restore only from a signed
            checkpoint (or with Restoring(allow_pickle=True)) of the same torch version and
            device kind (worker/compilecache/compile_cache.py). Nothing is written when nothing
            was compiled or torch has no such API.
        compile_cache_max_mb: Artifacts larger than this are neither saved nor loaded.
    """

    async_mode: AsyncMode = "off"
    fsync: bool = True
    sharded: bool | None = None
    trainable_only: bool = False
    on_failure: bool = True
    failure_timeout_s: float = FAILURE_SAVE_TIMEOUT_S
    # Left out: MEMORY_DEFAULT itself, which the Checkpointer tells from a Memory() the
    # script names (the tier on where it fits, quietly off outside `rtrain launch`).
    memory: Memory | int | Literal["auto"] | None = dataclasses.field(
        default_factory=lambda: MEMORY_DEFAULT)
    compile_cache: bool = True
    compile_cache_max_mb: float = 512.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory", as_memory(self.memory))
        if not self.compile_cache_max_mb > 0:
            raise ValueError(f"Saving(compile_cache_max_mb=) must be positive, not "
                             f"{self.compile_cache_max_mb!r}")
        if self.async_mode not in ("off", "auto", "fork", "thread"):
            raise ValueError(f"Saving(async_mode=) is 'off', 'auto', 'fork' or 'thread', not "
                             f"{self.async_mode!r}")
        if not self.failure_timeout_s > 0:
            raise ValueError(f"Saving(failure_timeout_s=) must be positive, not "
                             f"{self.failure_timeout_s!r}")


@dataclass(frozen=True, kw_only=True)
class Restoring:
    """How `restore()` reads a checkpoint.

    Attributes:
        verify: "full" also recomputes every file's hash as it is read and compares it with
            the manifest; "quick" checks the manifest, its signature (with a key), file names
            and sizes only (very large checkpoints on trusted storage).
        map_location: Where tensors are loaded (as torch.load's `map_location`); the
            components' load_state_dict then move them where they belong.
        allow_resize: Load a replicated (unsharded) checkpoint saved by a different number
            of ranks: the model and optimizer load, the resume is not bitwise exact (one RNG
            state per rank). Sharded checkpoints reshard without it.
        allow_pickle: Let DCP's own reader unpickle a sharded checkpoint's metadata: it runs
            code from the checkpoint, so trusted checkpoints only. Without it, sharded
            checkpoints are read without unpickling.
    """

    verify: Literal["quick", "full"] = "full"
    map_location: str | torch.device = "cpu"
    allow_resize: bool = False
    allow_pickle: bool = False

    def __post_init__(self) -> None:
        if self.verify not in ("quick", "full"):
            raise ValueError(f"Restoring(verify=) is 'quick' or 'full', not {self.verify!r}")

    @property
    def level(self) -> Level:
        return Level(self.verify)


@dataclass(frozen=True, kw_only=True)
class Memory:
    """The memory tier: snapshots in shared memory, taken every few steps between disk saves.
    `Saving(memory=5)` is `Saving(memory=Memory(every=5))`; `memory="auto"` is `Memory()`.
    Under `rtrain launch` only (it gives the directory and persists the snapshots): when the
    process dies by any cause, rtrain commits the newest complete snapshot to the checkpoint
    dir and the relaunch restores from memory. Scheduled disk saves are then snapshots too,
    copied to the checkpoint dir by rtrain in the background. Under torchrun, replicated (DDP)
    state only (sharded state is saved to disk); a warning says when the tier stays off.

    Attributes:
        every: Snapshot when the step is a multiple of this. "auto" snapshots at the first
            step, then picks the interval from what snapshots cost the steps they ran beside
            (measured, a moving estimate): the fewest steps that keep that cost within 3% of
            the step time, longer where the run's observed failures are rare enough that
            Young/Daly's optimum is (worker/memtier/pacing.py).
        overlap: Copy the model and optimizer state from a background thread while the next
            step's forward and backward run; the optimizer's next `step()` waits until the
            copy is done (under "auto" it
            abandons one not done yet instead: that snapshot is skipped, the one before stays
            whole; two in a row at most), so the stall is what the copy does not hide. With it,
            a single process's parameters and optimizer state live in shared memory (the live
            state: a SIGKILL outside `optimizer.step()` loses no step, with no copy). False
            when the loop changes weights or optimizer state outside `optimizer.step()` (an
            EMA written into the model, weights clipped before the step): the copy then
            finishes inside `maybe_save`, and there is no live state.
        budget_mb: Host memory the tier may hold: two snapshots (the newest complete one and
            the one being written, or kept to be written into). None: half of the memory
            available when it starts, and of what the run's memory cgroup has left below its
            limit. A state that does not fit twice leaves the tier off, with a warning.
    """

    every: int | Literal["auto"] = "auto"
    overlap: bool = True
    budget_mb: float | None = None

    def __post_init__(self) -> None:
        if self.every != "auto" and (not _is_int(self.every) or self.every < 1):
            raise ValueError(f"Memory(every=) takes a whole number of at least 1 or 'auto', "
                             f"not {self.every!r}")
        if self.budget_mb is not None and not self.budget_mb > 0:
            raise ValueError(f"Memory(budget_mb=) must be positive, not {self.budget_mb!r}")


def as_every(value: Any) -> Every:
    """`every=`: a number of steps, "auto", an Every, or None (no schedule)."""
    if value is None:
        return Every()
    if isinstance(value, Every):
        return value
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return Every(steps=value)
    raise TypeError(f"every= takes a number of steps, 'auto' or an Every(...), not {value!r}")


def as_keep(value: Any) -> Keep:
    """`keep=`: how many of the newest to keep (None: all), or a Keep."""
    if isinstance(value, Keep):
        return value
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return Keep(last=value)
    raise TypeError(f"keep= takes a number of checkpoints, None (keep all) or a Keep(...), "
                    f"not {value!r}")


MEMORY_DEFAULT = Memory()
"""`Saving(memory=)` left out (compared by identity): the tier where it fits."""


def as_memory(value: Any) -> Memory | None:
    """`Saving(memory=)`: None, 0 or False (no memory tier), a number of steps, "auto", or a
    Memory."""
    if value is None or value is False or (_is_int(value) and value == 0):
        return None
    if isinstance(value, Memory):
        return value
    if value == "auto" or _is_int(value):
        return Memory(every=value)
    raise TypeError(f"Saving(memory=) takes a number of steps, 'auto', a Memory(...) or None "
                    f"(off), not {value!r}")


def as_group(cls: type, value: Any, name: str) -> Any:
    """`saving=`/`restoring=`: an instance of the group's class, or None for its defaults."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise TypeError(f"{name}= takes a {cls.__name__}(...), not {type(value).__name__}")
    return value



GROUPS = (Every, Keep, Saving, Restoring, Memory)


def reference() -> str:
    """The option groups' docstrings, one after another: appended to the Checkpointer's."""
    parts = []
    for cls in GROUPS:
        fields = ", ".join(f"{f.name}={_default(f)!r}" for f in dataclasses.fields(cls))
        parts.append(f"{cls.__name__}({fields})\n    " +
                     (inspect.getdoc(cls) or "").replace("\n", "\n    "))
    return "\n\n".join(parts)


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
