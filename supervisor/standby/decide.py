"""The warm standby: when to start one, when to drop one, whether an attempt may use it.

Pure functions of what the supervisor observed; standby/warm_child.py and standby/slot.py carry
them out. A standby is a clean interpreter that has imported the heavy modules; it is only
worth using when it is exactly what a cold start would have become at its first line, so every
doubt (an import-time variable changed, a preloaded file changed, CUDA touched, not the same
program) means a cold start.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SPAWN_AFTER_S = 5.0
"""Started once the attempt has trained this long (or sent its first heartbeat): its own
imports and start-up are not slowed by a second interpreter importing the same libraries. A
standby forked from a ready zygote imports nothing and is started at the first sample; so is
the zygote itself where a core stays idle beside the attempt's start (SpawnFacts.idle_core)."""
ASSUMED_RSS = 512 * 2**20
"""The memory a standby is assumed to take before one has been measured in this launch."""
MAX_FAILURES = 2
"""After this many standbys failed in one launch, the launch starts its attempts cold."""
STALE_CHECK_S = 10.0
"""How often a waiting standby's files are compared with what it imported (a stat each)."""

Stamp = Sequence[int]
"""A file's (device, inode, size, mtime_ns, ctime_ns): standby/child_program.file_stamp."""
MTIME, CTIME = 3, 4


def changed_files(recorded: Mapping[str, Stamp], now: Mapping[str, Stamp | None],
                  spawned_ns: int, stamped_ns: int) -> list[str]:
    """The files a standby runs code from that a cold start would no longer find as they were.

    `recorded`: each file's stamp, taken by the standby after its imports (at `stamped_ns`);
    `now`: the same files' stamps now (None: gone, or no longer a regular file). A file is
    changed when it is gone or any part of its stamp differs: an edit moves mtime and ctime, a
    copy that kept an old mtime (`cp -p`, `rsync -t`) still moves ctime, which only the kernel
    sets, and one renamed into place has a new inode. A file whose recorded mtime or ctime lies
    between the spawn and the record changed while the standby imported: it may have been read
    before the change, so it counts as changed too (the bound above keeps a file stamped in the
    future by a skewed clock from recycling every standby)."""
    out = []
    for path, stamp in recorded.items():
        current = now.get(path)
        if (current is None or list(current) != list(stamp)
                or any(spawned_ns <= stamp[i] <= stamped_ns for i in (MTIME, CTIME))):
            out.append(path)
    return out


def import_time_env_changes(standby_env: Mapping[str, str],
                            attempt_env: Mapping[str, str]) -> list[str]:
    """Variables, RTRAIN_* excepted, that differ between the standby's start and the attempt:
    a library may have read any of them at import (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS,
    PYTORCH_*, LD_*, PYTHON*), so one difference makes the standby unusable."""
    keys = {k for k in (*standby_env, *attempt_env) if not k.startswith("RTRAIN_")}
    return sorted(k for k in keys if standby_env.get(k) != attempt_env.get(k))


def host_tight(used: int, limit: int, fraction: float, extra: int = 0) -> bool:
    """Whether the host (or the run's cgroup) is at its pressure threshold, with `extra` more
    bytes in use. A standby is not worth memory the training may need."""
    return limit > 0 and used + extra >= fraction * limit


@dataclass(frozen=True, kw_only=True)
class SpawnFacts:
    enabled: bool
    """`standby = true` and the command is a plain `python SCRIPT` or `python -m MODULE`."""
    failures: int
    """Standbys that failed in this launch."""
    running_s: float
    """How long the current attempt has run."""
    heartbeat_seen: bool
    """The current attempt sent a heartbeat (it trains)."""
    host_used: int
    host_limit: int
    fraction: float
    standby_rss: int | None
    """The last measured standby's RSS; None: none measured yet."""
    pressure: bool = False
    """Memory pressure rose in this attempt (a standby was dropped for it, or none waited)."""
    zygote_ready: bool = False
    """A zygote waits with the preload imported: a standby forked from it imports nothing,
    so it takes nothing from the attempt's start and is forked without waiting."""
    idle_core: bool = False
    """A core's worth of CPU went unused since the attempt started (standby/idle.py): what is
    spawned imports there, beside the attempt's own imports, without slowing them, and is
    ready seconds sooner for a failure early in the attempt (the first of a launch above
    all, which finds no zygote yet)."""


def should_spawn(f: SpawnFacts) -> tuple[bool, str]:
    """(spawn now, why not)."""
    if not f.enabled:
        return False, "off"
    if f.failures >= MAX_FAILURES:
        return False, f"{f.failures} standbys failed in this launch"
    if (not f.heartbeat_seen and f.running_s < SPAWN_AFTER_S and not f.zygote_ready
            and not f.idle_core):
        return False, "the attempt is starting"
    if f.pressure:
        return False, "memory pressure rose in this attempt"
    need = f.standby_rss if f.standby_rss is not None else ASSUMED_RSS
    if host_tight(f.host_used, f.host_limit, f.fraction, need):
        return False, "host memory is tight"
    return True, ""


@dataclass(frozen=True, kw_only=True)
class UseFacts:
    ready: bool
    failed: str | None
    """Why the standby failed (died, import error, no answer); None: it did not."""
    cuda: bool
    """CUDA was initialised in it (its preload did it)."""
    env_changes: Sequence[str]
    """import_time_env_changes(...)"""
    stale: Sequence[str]
    """Files it imported (or the script) changed since it was spawned."""
    same_target: bool
    """The attempt runs the program the standby was spawned for."""


@dataclass(frozen=True)
class Use:
    use: bool
    event: str = ""
    """"" when used; "standby_failed" or "standby_discarded" otherwise."""
    reason: str = ""


def at_launch(f: UseFacts) -> Use:
    """Whether the next attempt starts in the standby; otherwise which event says why."""
    if f.failed is not None:
        return Use(False, "standby_failed", f.failed)
    if f.cuda:
        return Use(False, "standby_failed", "CUDA was initialised while preloading")
    if not f.ready:
        return Use(False, "standby_failed", "not ready")
    if not f.same_target:
        return Use(False, "standby_discarded", "the attempt runs another program")
    if f.env_changes:
        names = ", ".join(f.env_changes[:5]) + (" ..." if len(f.env_changes) > 5 else "")
        return Use(False, "standby_discarded",
                   f"import-time environment changed: {names}")
    if f.stale:
        return Use(False, "standby_discarded", f"changed since it was imported: {f.stale[0]}")
    return Use(True)


def while_waiting(*, stale: Sequence[str], tight: bool) -> str | None:
    """Why a waiting standby must go now (then a new one may replace it); None: keep it."""
    if tight:
        return "host memory is tight"
    if stale:
        return f"changed since it was imported: {stale[0]}"
    return None
