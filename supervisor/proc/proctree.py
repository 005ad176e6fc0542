"""Sample the attempt's process tree: memory, CPU progress, host memory; remember every pid seen.

The tree is every descendant of the supervisor (it runs one attempt at a time, and as a subreaper
it also adopts processes that escaped the attempt's group with setsid). One sample reads each
tree process's /proc files once plus one ppid scan of /proc, about a millisecond on a quiet host:
far under 1% of a core at 1 Hz.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass

import psutil

# Below one clock tick of CPU the tree counts as idle: a process asleep in a hang shows zero.
CPU_PROGRESS_S = 0.01


@dataclass(frozen=True)
class TreeSample:
    time: float  # the caller's clock
    pids: tuple[int, ...]
    rss_bytes: int  # summed over the tree (shared pages counted per process)
    cpu_s: float  # user+system of the live tree processes
    cpu_progress: bool  # the tree used CPU since the previous sample
    host_mem_available: int
    host_mem_total: int


def _read_ppid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # exited meanwhile
        return None
    return int(stat[stat.rfind(b")") + 2 :].split(None, 2)[1])


def descendants(root: int, ppids: dict[int, int] | None = None,
                exclude: Collection[int] = ()) -> list[int]:
    """Pids below `root`, from one scan of /proc (per-process child lists need
    CONFIG_PROC_CHILDREN, which many kernels lack).

    `ppids` caches pid -> ppid between calls: a process changes parent only when re-parented
    (to a subreaper or init), which never moves it into our tree from outside, so only new pids
    need a read. That keeps a sample cheap on hosts with thousands of processes.
    `exclude`: pids whose subtrees are left out (the supervisor's own helpers, e.g. hooks).
    """
    cache = {} if ppids is None else ppids
    fresh: dict[int, int] = {}
    children: dict[int, list[int]] = {}
    pids = {int(name) for name in os.listdir("/proc") if name.isdigit()}
    for pid in pids:
        ppid = cache.get(pid)
        # A parent changes only when the old one dies (re-parenting to init or to us, the
        # subreaper): a cached parent that still exists is still the parent.
        if ppid is None or (ppid not in pids and ppid > 1):
            ppid = _read_ppid(str(pid))
            if ppid is None:
                continue
        fresh[pid] = ppid
        children.setdefault(ppid, []).append(pid)
    if ppids is not None:
        ppids.clear()
        ppids.update(fresh)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


class ProcTree:
    """Samples the descendants of `root` (default: this process) and remembers all it saw."""

    def __init__(self, root: int | None = None, *,
                 exclude: Callable[[], Collection[int]] | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self.exclude = exclude  # pids of the supervisor's helpers: not part of the attempt
        self.seen: dict[int, psutil.Process] = {}  # keeps create_time: safe against pid reuse
        self._ppids: dict[int, int] = {}
        self._cpu: dict[int, float] = {}
        self.peak_rss = 0
        self.min_available: int | None = None

    def _process(self, pid: int) -> psutil.Process | None:
        proc = self.seen.get(pid)
        if proc is not None and proc.is_running():
            return proc
        self._ppids.pop(pid, None)  # a reused pid: its parent must be read again
        try:
            proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None
        self.seen[pid] = proc
        return proc

    def live(self) -> list[psutil.Process]:
        """Current descendants, plus any process seen earlier that still runs (wherever it went).
        The parent cache re-reads every process whose cached parent has died, which is all that
        re-parenting can change."""
        procs = {}
        skip = self.exclude() if self.exclude is not None else ()
        for pid in descendants(self.root, self._ppids, skip):
            proc = self._process(pid)
            if proc is not None:
                procs[pid] = proc
        for pid, proc in self.seen.items():
            if pid not in procs and proc.is_running():
                procs[pid] = proc
        return list(procs.values())

    def sample(self, now: float) -> TreeSample:
        rss, cpu, progress, cpu_now = 0, 0.0, False, {}
        pids = []
        for proc in self.live():
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    mem = proc.memory_info()
            except psutil.NoSuchProcess:  # ZombieProcess included
                continue
            pids.append(proc.pid)
            rss += mem.rss
            used = times.user + times.system
            cpu += used
            cpu_now[proc.pid] = used
            if used - self._cpu.get(proc.pid, 0.0) >= CPU_PROGRESS_S:
                progress = True
        self._cpu = cpu_now
        vm = psutil.virtual_memory()
        self.peak_rss = max(self.peak_rss, rss)
        if self.min_available is None or vm.available < self.min_available:
            self.min_available = vm.available
        return TreeSample(now, tuple(pids), rss, cpu, progress, vm.available, vm.total)
