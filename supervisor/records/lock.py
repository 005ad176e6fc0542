"""One supervisor per run directory: an exclusive `flock` on `<run-dir>/.rtrain.lock`.

The kernel drops a flock when its holder dies, so a lock left by a killed rtrain is free
again without any cleanup. The holder's pid, host and start time are written inside the
file, only so that a refused launch can name who holds the run; they never decide who owns
it. The file is never deleted: unlinking a lock file lets two processes lock two inodes.
The descriptor is close-on-exec, so the training child does not inherit the lock.

The file is opened through `ownfiles.open_own`: a link, a FIFO or a second name of another file
planted at `.rtrain.lock` is refused (exit 2) before anything is written, and a file there that
holds more than any holder's name is not an rtrain lock and is refused rather than truncated.
Its content is only read for a message, so nothing in it (a forged start time, a huge number,
NaN) can turn a refusal into anything but the refusal.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.errors import AlreadySupervised
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE
from rtrain.supervisor.core.pid_alive import pid_alive
from rtrain.supervisor.core.untrusted_text import safe

LOCK_NAME = ".rtrain.lock"
HOLDER_MAX = 4096  # bytes: a holder's name is far less; more is not an rtrain lock


class RunLock:
    """`with RunLock(run_dir) as lock:` holds the run dir; `lock.previous` describes a stale
    holder that was taken over (pid no longer alive), for the event log."""

    def __init__(self, run_dir: Path, *, clock: Callable[[], float] = time.time,
                 mode: int = DEFAULT_FILE_MODE) -> None:
        self.run_dir = Path(run_dir)
        self.mode = mode  # the run's file-mode policy (supervisor/core/filemode.py)
        self.path = self.run_dir / LOCK_NAME
        self.clock = clock
        self.previous: dict[str, Any] | None = None
        self._fd = -1

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        opened = ownfiles.open_own(self.path, os.O_RDWR, create=True, mode=self.mode)
        fd = opened.fd
        try:
            if opened.st.st_size > HOLDER_MAX:
                raise ownfiles.RefusedFile(self.path, f"holds {opened.st.st_size} bytes, not "
                                                      "the name of an rtrain holding the run")
            ownfiles.own_mode(opened, self.mode)  # also a lock an older rtrain made 0644
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise AlreadySupervised(self._refusal(holder)) from None
        except BaseException:
            os.close(fd)
            raise
        previous = _read_holder(fd)
        if previous and previous.get("pid") != os.getpid():
            same_host = previous.get("host") == socket.gethostname()
            # We hold the flock, so the recorded holder does not: it died, or its pid was reused.
            if same_host and isinstance(previous.get("pid"), int):
                previous["alive"] = pid_alive(previous["pid"])
            self.previous = previous
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": self.clock()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                os.close(fd)
                raise
            # A full disk: the holder's name is only for messages, the flock holds the run.
        self._fd = fd
        return self

    def _refusal(self, holder: dict[str, Any]) -> str:
        # Anyone who can write the run dir wrote this content: only well-formed values show.
        pid = holder.get("pid")
        pid = pid if isinstance(pid, int) and not isinstance(pid, bool) else "?"
        host = holder.get("host")
        where = (f" on {safe(host)}" if isinstance(host, str) and host
                 and host != socket.gethostname() else "")
        when = _when(holder.get("started"))
        return (f"run dir {safe(self.run_dir)} is already supervised by rtrain pid "
                f"{pid}{where}{when}; stop it or use another --run-dir")

    def release(self) -> None:
        if self._fd >= 0:
            os.ftruncate(self._fd, 0)  # no stale name left for the next reader
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, HOLDER_MAX, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError, RecursionError):
        return {}  # a holder killed while writing its name: nothing to report
    return info if isinstance(info, dict) else {}


def _when(started: Any) -> str:
    """" (started <local time>)" for a start time a clock can show, else nothing."""
    if (not isinstance(started, (int, float)) or isinstance(started, bool)
            or not math.isfinite(started)):
        return ""
    try:
        return f" (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))})"
    except (OverflowError, OSError, ValueError):  # past what localtime() can show
        return ""
