"""Stopping an attempt: stop signal to the group, a monotonic deadline, SIGKILL, then the sweep.

The sweep matters as much as the kill: a DataLoader worker or a `setsid` helper that outlives the
child keeps GPU memory and the port, and the relaunch then fails for reasons unrelated to training.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from rtrain.supervisor.proc.proctree import ProcTree
from rtrain.supervisor.proc.spawn import Child

CONFIRM_S = 2.0  # how long the sweep waits for SIGKILLed processes to disappear


@dataclass
class StopResult:
    returncode: int | None  # subprocess style: negative = killed by that signal
    signal_sent: str | None  # the polite signal, if the child was still running
    killed_after_grace: bool  # the child outlived the grace and got SIGKILL
    swept: list[int] = field(default_factory=list)  # descendants killed after the child ended
    leftovers: list[int] = field(default_factory=list)  # still there after the bounded wait
    duration_s: float = 0.0


def signal_group(child: Child, sig: int) -> bool:
    """Send `sig` to the child's process group; False when the group is gone.

    SIGCONT follows a polite signal: a stopped (SIGSTOP/SIGTSTP) process cannot act on it.
    """
    try:
        os.killpg(child.pgid, sig)
        if sig not in (signal.SIGKILL, signal.SIGCONT):
            os.killpg(child.pgid, signal.SIGCONT)
    except ProcessLookupError:
        return False
    return True


def wait_exit(child: Child, deadline: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until the child exits or `clock()` reaches `deadline`; True if it exited (reaped)."""
    while child.returncode is None:
        remaining = deadline - clock()
        if remaining <= 0:
            return False
        if child.pidfd is not None:
            select.select([child.pidfd], [], [], remaining)
        else:
            time.sleep(min(remaining, 0.01))
    return True


def sweep(
    child: Child, tree: ProcTree | None, *, confirm_s: float = CONFIRM_S
) -> tuple[list[int], list[int]]:
    """SIGKILL the group and every remaining descendant; return (killed pids, leftover pids).

    Call once the child itself has been reaped. Descendants are today's tree of the supervisor
    (which, as subreaper, adopted escapees) plus every process `tree` saw that still runs.
    """
    try:
        os.killpg(child.pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    tree = tree or ProcTree()
    procs = [p for p in tree.live() if p.pid != child.pid]
    killed = []
    for proc in procs:
        try:
            proc.kill()  # psutil checks create_time first: a reused pid is left alone
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            pass
    # wait_procs reaps our own children (adopted orphans) and polls the rest.
    _, alive = psutil.wait_procs(procs, timeout=confirm_s)
    leftovers = [p.pid for p in alive if _status(p) != psutil.STATUS_ZOMBIE]
    return killed, leftovers


def _status(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


def stop_group(
    child: Child,
    sig: int,
    grace_s: float,
    *,
    clock: Callable[[], float] = time.monotonic,
    tree: ProcTree | None = None,
    confirm_s: float = CONFIRM_S,
) -> StopResult:
    """Stop the attempt for good, blocking: `sig` to the group, wait up to `grace_s`, SIGKILL,
    reap, sweep descendants. Output is not drained meanwhile; the watch loop escalates without
    blocking and only calls `sweep` (use this from outside a watch, e.g. on an error)."""
    start = clock()
    sent = None
    killed_after_grace = False
    if child.returncode is None:
        if signal_group(child, sig):
            sent = signal.Signals(sig).name
        if not wait_exit(child, start + grace_s, clock):
            killed_after_grace = True
            signal_group(child, signal.SIGKILL)
            wait_exit(child, clock() + confirm_s, clock)  # bounded: a D-state process may linger
    swept, leftovers = sweep(child, tree, confirm_s=confirm_s)
    return StopResult(
        returncode=child.returncode,
        signal_sent=sent,
        killed_after_grace=killed_after_grace,
        swept=swept,
        leftovers=leftovers,
        duration_s=clock() - start,
    )
