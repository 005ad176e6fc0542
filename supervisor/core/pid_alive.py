"""Whether a process id still names a running process on this host, torch-free.

Used where rtrain finds a pid written down by another process (the lock's holder, a
checkpoint temp dir's writer) and must tell a live owner from a dead one. Signal 0 checks
existence without touching the process; a process of another user exists too (EPERM).
A pid says nothing about another host: callers check the host first.
"""

from __future__ import annotations

import os

PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: no pid is larger


def pid_alive(pid: int) -> bool:
    """True while `pid` exists on this host (a zombie not yet reaped counts as alive). A value
    no process can have (0 and negatives name process groups to kill(), huge ones overflow) is
    not alive."""
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
