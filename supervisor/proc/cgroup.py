"""A process's memory cgroup: its OOM-kill counter (evidence for `oom_host`), and its limit
and working set (what memory pressure is measured against, pressure/monitor.py).

cgroup v1 keeps the counter as `oom_kill N` in memory.oom_control, v2 in memory.events. A process
in a shared group (the usual case without a limit of our own) counts every OOM kill in that
group, so the watcher uses the counter's increase during an attempt as evidence, not as proof.

The working set is usage minus the inactive file cache (memory.stat), as container runtimes
count it: the kernel reclaims that cache before it kills anyone, so a run that reads a lot of
data is not under pressure for its page cache alone.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V1_ROOT = Path("/sys/fs/cgroup/memory")
_UNLIMITED = 1 << 62  # v1's "no limit" is PAGE_COUNTER_MAX pages in bytes, near 2**63


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path  # the group's directory
    version: int  # 1 or 2

    @property
    def counter_file(self) -> Path:
        return self.path / ("memory.oom_control" if self.version == 1 else "memory.events")

    def oom_kills(self) -> int | None:
        """The group's oom_kill counter; None when unreadable (group gone, old kernel)."""
        try:
            text = self.counter_file.read_text()
        except OSError:
            return None
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return None

    def limit(self) -> int | None:
        """The group's hard memory limit in bytes; None when it has none (v1 writes a number
        near 2**63 for "unlimited", v2 `max`) or it cannot be read."""
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        try:
            text = (self.path / name).read_text().strip()
        except OSError:
            return None
        if not text.isdigit() or int(text) >= _UNLIMITED:
            return None
        return int(text)

    def working_set(self) -> int | None:
        """Usage minus inactive file cache, in bytes; None when unreadable."""
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        stat_key = "total_inactive_file" if self.version == 1 else "inactive_file"
        try:
            usage = int((self.path / name).read_text())
            stat = (self.path / "memory.stat").read_text()
        except (OSError, ValueError):
            return None
        for line in stat.splitlines():
            key, _, value = line.partition(" ")
            if key == stat_key:
                return max(0, usage - int(value))
        return usage


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of each cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[3], fields[4], rfields[0], rfields[-1]))
    return out


def memory_cgroup(pid: int) -> MemoryCgroup | None:
    """The memory cgroup `pid` is in, as a directory we can read; None if it cannot be found."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    for root, point, fstype, opts in _mounts():
        if fstype == "cgroup" and v1 is not None and "memory" in opts.split(","):
            found = _under(point, root, v1, 1)
        elif fstype == "cgroup2" and v1 is None and v2 is not None:
            found = _under(point, root, v2, 2)
        else:
            continue
        if found is not None:
            return found
    return None


def _under(point: str, root: str, path: str, version: int) -> MemoryCgroup | None:
    # The mount shows the hierarchy from `root` down (inside containers root is not "/").
    rel = os.path.relpath(path, root)
    if rel.startswith(".."):
        return None
    group = MemoryCgroup(Path(point) / rel if rel != "." else Path(point), version)
    return group if group.counter_file.exists() else None


@contextlib.contextmanager
def limited_v1_group(limit_bytes: int, root: Path = V1_ROOT) -> Iterator[MemoryCgroup]:
    """A fresh cgroup-v1 memory group with a hard limit, removed afterwards (for tests).

    Raises OSError (with the reason) where groups cannot be made: no v1 memory controller, not
    root, read-only cgroupfs. Callers skip on it.
    """
    path = root / f"rtrain-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    try:
        # Swap would turn a kill into endless thrashing; set it where the kernel allows.
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):
            (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
        with contextlib.suppress(OSError):
            (path / "memory.swappiness").write_text("0")
        yield MemoryCgroup(path, 1)
    finally:
        _remove(path)


def _remove(path: Path) -> None:
    # rmdir fails while a process is still in the group (EBUSY): move stragglers out first.
    with contextlib.suppress(OSError):
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (path.parent / "cgroup.procs").write_text(pid)
    with contextlib.suppress(OSError):
        path.rmdir()
