"""Signals that reach the supervisor while it watches: handlers that only record them.

The signal wakeup fd wakes the watch's select loop; the loop takes the recorded signals and
acts on them (proc/watch.py). Saving, stopping and logging never happen in a handler.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


class SignalCatcher:
    """Handlers that only record the signal; the wakeup fd wakes the select loop.

    A context manager: installs on enter, restores the previous handlers on exit. Only the main
    thread may install handlers; elsewhere it catches nothing (and says so once in the log).
    """

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.pending: list[int] = []
        self._rfd: int | None = None
        self._wfd: int | None = None
        self._old: dict[int, object] = {}
        self._old_fd = -1

    def _record(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def __enter__(self) -> SignalCatcher:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not on the main thread: signals are left to the default handlers")
            return self
        self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for sig in self.signals:
            self._old[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._rfd is None:
            return
        for sig, old in self._old.items():
            # None: the old handler was installed from C and cannot be restored from Python
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._rfd)
        os.close(self._wfd)  # type: ignore[arg-type]
        self._rfd = self._wfd = None

    def fileno(self) -> int | None:
        return self._rfd

    def take(self) -> list[int]:
        """Signals received since the last call, oldest first."""
        if self._rfd is not None:
            try:
                while os.read(self._rfd, 512):
                    pass
            except BlockingIOError:
                pass
        taken, self.pending[:] = list(self.pending), []
        return taken
