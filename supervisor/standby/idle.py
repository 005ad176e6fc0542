"""Idle cores, measured: whether the launch's zygote can import beside an attempt's start.

The zygote imports the script's libraries (torch: seconds of one core). Started beside the
first attempt it makes the first failure of a launch recover as fast as later ones, but only
where a core would otherwise sit idle: on a host whose cores are all busy (many launches, a
test suite) it would take its share from the attempts, even at the lowest priority, and gain
nothing before its import ends. So the slot reads the kernel's per-CPU idle time over the
attempt's start and starts the zygote then only when at least a core's worth went unused.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CpuTimes = Mapping[int, tuple[int, int]]
"""Per CPU number: (idle ticks, all ticks) since boot, from /proc/stat."""


def read(path: str = "/proc/stat") -> CpuTimes:
    """Each CPU this process may run on (its affinity mask, so a cpuset counts, not the whole
    host): its idle and iowait ticks (a CPU waiting for I/O runs nothing) and all its ticks.
    Empty where /proc/stat cannot be read (then no core is known idle)."""
    try:
        allowed = os.sched_getaffinity(0)
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out: dict[int, tuple[int, int]] = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in allowed:
            continue
        ticks = [int(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user]
        out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks[:8]))
    return out


def idle_cores(before: CpuTimes, after: CpuTimes) -> float:
    """How many cores' worth went unused between the two readings (0.0 .. the CPU count);
    0.0 when no tick passed (a window too short to tell)."""
    total = 0.0
    for cpu, (idle1, all1) in after.items():
        if cpu not in before:
            continue
        idle0, all0 = before[cpu]
        if all1 > all0:
            total += max(0, idle1 - idle0) / (all1 - all0)
    return total
