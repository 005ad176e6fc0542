"""One supervisor per run directory: an exclusive `flock` on `<run-dir>/.rtrain.lock`.

The kernel drops a flock when its holder dies, so a lock left by a killed rtrain is free
again without any cleanup. The holder's pid, host and start time are written inside the
file, only so that a refused launch can name who holds the run; they never decide who owns
it. The file is never deleted: unlinking a lock file lets two processes lock two inodes.
The descriptor is close-on-exec, so the training child does not inherit the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.errors import AlreadySupervised
from supervisor.filemode import DEFAULT_FILE_MODE, set_mode
from supervisor.fsio import STORAGE_ERRNOS
from supervisor.pids import pid_alive

LOCK_NAME = ".rtrain.lock"


class RunLock:
    """`with RunLock(run_dir) as lock:` holds the run dir; `lock.previous` describes a stale
    holder that was taken over (pid no longer alive), for the event log."""

    def __init__(self, run_dir: Path, *, clock: Callable[[], float] = time.time,
                 mode: int = DEFAULT_FILE_MODE) -> None:
        self.run_dir = Path(run_dir)
        self.mode = mode  # the run's file-mode policy (supervisor/filemode.py)
        self.path = self.run_dir / LOCK_NAME
        self.clock = clock
        self.previous: dict[str, Any] | None = None
        self._fd = -1

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, self.mode)
        set_mode(fd, self.mode)  # also a lock file an older rtrain made world-readable
        try:
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
        pid = holder.get("pid", "?")
        host = holder.get("host")
        where = f" on {host}" if host and host != socket.gethostname() else ""
        started = holder.get("started")
        when = (f" (started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))})"
                if isinstance(started, (int, float)) else "")
        return (f"run dir {self.run_dir} is already supervised by rtrain pid {pid}{where}{when}; "
                "stop it or use another --run-dir")

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
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}  # a holder killed while writing its name: nothing to report
    return info if isinstance(info, dict) else {}
