"""Reaping orphans: rtrain waits for every exited child it did not start itself.

rtrain is a child subreaper (proc/spawn.py), and in a container it is often PID 1: either way a
process below it whose parent dies (a daemonized helper, a DataLoader worker's own child, a
shell's background job) is re-parented to rtrain, and when that orphan exits it stays a zombie
until rtrain waits for it. Over a long run zombies fill the pid table (a container's pids
limit first). The processes rtrain starts itself are registered here (`own`): their Popen
objects wait for them and must get their exit status, so the reaper leaves those alone.

`reap_orphans` runs on the launch loop's thread only (each watch sample), the thread that
starts and polls rtrain's own processes, so a Popen is always registered before the reaper can
see its process. It does nothing until `enable()`: the `rtrain` command enables it, a program
that calls rtrain's functions in its own process (a test runner) keeps its children to itself.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

_own: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
_enabled = False


def enable() -> None:
    """Reap from now on: this process is rtrain itself (the CLI), every child is its own."""
    global _enabled
    _enabled = True


def own(proc: subprocess.Popen) -> subprocess.Popen:
    """Register a process rtrain started and will wait for itself; returns it."""
    _own.add(proc)
    return proc


def reap_orphans() -> list[int]:
    """Wait for each exited child of ours that no registered Popen is waiting for; the pids."""
    if not _enabled:
        return []
    mine = {p.pid for p in list(_own) if p.returncode is None}
    reaped = []
    for pid in _zombie_children():
        if pid in mine:
            continue
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if done:
            reaped.append(done)
    return reaped


def _zombie_children() -> list[int]:
    """Our children that have exited and wait to be reaped."""
    return [pid for pid in _children() if _state(pid) == "Z"]


def _children() -> list[int]:
    # /proc/self/task/*/children lists just our children (no scan of every process on a large
    # host, once a second); kernels without CONFIG_PROC_CHILDREN get psutil's full scan.
    try:
        tasks = os.listdir("/proc/self/task")
        out: list[int] = []
        for tid in tasks:
            with open(f"/proc/self/task/{tid}/children") as f:
                out += [int(pid) for pid in f.read().split()]
        return out
    except FileNotFoundError:
        import psutil  # here: `rtrain --help` and the reading commands start without it

        try:
            return [p.pid for p in psutil.Process().children()]
        except psutil.Error:
            return []
    except OSError:
        return []


def _state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (Z: zombie); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The name in parentheses may hold spaces and parentheses: the state follows the last ")".
    return stat[stat.rfind(b")") + 2:][:1].decode() or None
