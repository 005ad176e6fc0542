"""Requests to the worker that must reach it while its training thread is stuck.

The worker reads them from a FIFO in its status dir (`protocol.CONTROL_FIFO`, created and read by
worker/saving/hang_save.py). Opening it for writing without blocking fails at once when no process
reads it (ENXIO), so a plain script, a worker under torch.distributed or a process that is gone
costs nothing: the request is simply not delivered.

Each request carries the attempt's token (RTRAIN_CONTROL_TOKEN, handed to the child in its
environment only); the worker serves nothing else. The token is written only into a FIFO of
our own user: a FIFO someone else put in the attempt dir (one who may write the run dir) never
receives it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from rtrain.supervisor.core.protocol import CONTROL_FAILSAVE, CONTROL_FIFO, control_request


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISFIFO(st.st_mode) and st.st_uid == os.geteuid()


def ask_failure_save(status_dir: Path, token: str | None) -> bool:
    """Ask the worker to save its last step boundary if nothing changed since; whether a
    reader took the request. `token`: the attempt's RTRAIN_CONTROL_TOKEN (None: the attempt
    was given none, so nothing would serve it)."""
    if not token:
        return False
    path = status_dir / CONTROL_FIFO
    try:
        before = os.lstat(path)
        if not _ours(before):
            return False  # never write into a file that happens to have the name
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENXIO, errno.EACCES, errno.ENOTDIR, errno.ELOOP):
            return False
        raise
    try:
        after = os.fstat(fd)  # the one opened, not one swapped in after the lstat
        if not _ours(after) or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            return False
        os.write(fd, control_request(CONTROL_FAILSAVE, token))
        return True
    except OSError:  # the reader went away between the open and the write
        return False
    finally:
        os.close(fd)
