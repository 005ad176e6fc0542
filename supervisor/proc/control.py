"""Requests to the worker that must reach it while its training thread is stuck.

The worker reads them from a FIFO in its status dir (`protocol.CONTROL_FIFO`, created and read
by worker/hang_save.py). Opening it for writing without blocking fails at once when no process
reads it (ENXIO), so a plain script, a worker under torch.distributed or a process that is gone
costs nothing: the request is simply not delivered.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from supervisor.protocol import CONTROL_FAILSAVE, CONTROL_FIFO


def ask_failure_save(status_dir: Path) -> bool:
    """Ask the worker to save its last step boundary if nothing changed since; whether a
    reader took the request."""
    path = status_dir / CONTROL_FIFO
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            return False  # never write into a file that happens to have the name
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENXIO, errno.EACCES, errno.ENOTDIR, errno.ELOOP):
            return False
        raise
    try:
        os.write(fd, (CONTROL_FAILSAVE + "\n").encode())
        return True
    except OSError:  # the reader went away between the open and the write
        return False
    finally:
        os.close(fd)
