"""Save at a hang: serve the supervisor's request while the training thread is stuck.

When rtrain finds the process hung (no output, no heartbeat, no CPU progress for the hang timeout)
the training thread is blocked: in a data loader that stopped delivering, in a collective, on a dead
filesystem. If it blocked before the step's optimizer step, the model and optimizer in memory are
still the last completed step's, as for a crash in the forward (worker/saving/failsave.py). Signals
cannot reach that thread (a Python handler runs on the main thread only, between bytecodes), so the
request comes through a FIFO, `control` in the attempt's status dir, which a daemon thread of this
module reads. On `failsave` it runs the same save at the failure for every watched Checkpointer,
with `Hung` as the exception, then sends a `hang_save_done` heartbeat so that rtrain stops waiting
for the grace.

Only requests that carry the attempt's token (RTRAIN_CONTROL_TOKEN, which rtrain hands this
process in its environment and writes nowhere else) are served: the FIFO is this user's alone
(0600), but any of the user's programs could write to it. Any other line is refused, logged and
reported (`control_refused` heartbeat, a `control_refused` event in the run's log). A FIFO
found replaced by another file (the attempt dir may be writable by a group) is no longer read.
The reader holds the FIFO open for writing too, so that a request never finds it without a reader.

Consistency: the save is decided and written with the marks of worker/saving/failsave.py; an
optimizer step that starts meanwhile (the thread was slow, not hung) waits in its pre-hook until
the save ends (`hold_steps`), so the step's own writes never overlap the save's reads.

Only one process per status dir serves it: never under torch.distributed (a save there needs
every rank; the failure save declines it anyway).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import math
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.protocol import (
    CONTROL_FAILSAVE,
    CONTROL_FIFO,
    ENV_CONTROL_TOKEN,
    ENV_STATUS,
)
from rtrain.worker import runtime

log = logging.getLogger(__name__)

hold_steps = threading.Lock()
"""Held while a save at a hang runs; an optimizer step's pre-hook waits on it."""


class Hung(Exception):
    """What the save at a hang records as the failure (`failure` in the manifest's info)."""


_started = False
REQUEST_MAX = 256  # a longer line is no request of rtrain's
REFUSED_REPORT_S = 5.0  # refusals are reported at most this often (a writer in a loop)


def start(checkpointers: Callable[[], Iterable[Any]]) -> bool:
    """Create the FIFO and its reader thread once per process (run by rtrain, one process).
    `checkpointers` lists those that save at a failure. Whether it serves."""
    global _started
    status = os.environ.get(ENV_STATUS)
    token = os.environ.get(ENV_CONTROL_TOKEN)
    if _started or not status or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        return False
    if not token:  # an rtrain that hands out no token: nothing it sends could be served
        log.warning("no save at a hang: rtrain gave this process no %s", ENV_CONTROL_TOKEN)
        return False
    path = Path(status) / CONTROL_FIFO
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a FIFO left by an earlier process of this attempt dir
        os.mkfifo(path, 0o600)
        st = os.lstat(path)
    except OSError as e:
        log.warning("no save at a hang: cannot create %s (%s)", path, e.strerror)
        return False
    _started = True
    threading.Thread(target=serve, args=(path, (st.st_dev, st.st_ino), token, checkpointers),
                     name="rtrain-hang-save", daemon=True).start()
    return True


def serve(path: Path, ident: tuple[int, int], token: str,
          checkpointers: Callable[[], Iterable[Any]],
          clock: Callable[[], float] = time.monotonic, poll_s: float = 1.0) -> None:
    """Read requests from the FIFO `path` (the one we made: `ident` is its device and inode)
    until it fails or is replaced; serve those with `token`, report the others."""
    refused = Refusals(path, clock)
    try:
        # Opened for reading and writing, so that the FIFO always has a reader and never ends:
        # read-only, it ends with each writer, and a request written between the end and the
        # next open would be refused (no reader) or dropped with the closed end's buffer.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        log.warning("save at a hang not served: %s", e)
        return
    try:
        if _replaced(os.fstat(fd), ident):
            log.warning("save at a hang not served: %s was replaced", path)
            return
        for line in _lines(fd, lambda: _replaced(_lstat(path), ident), poll_s):
            if is_request(line, token):
                save_all(checkpointers())
            else:
                refused.add()
        log.warning("save at a hang no longer served: %s was replaced", path)
    except OSError as e:
        log.warning("save at a hang no longer served: %s", e)
    finally:
        os.close(fd)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _replaced(st: os.stat_result | None, ident: tuple[int, int]) -> bool:
    return st is None or not stat.S_ISFIFO(st.st_mode) or (st.st_dev, st.st_ino) != ident


def _lines(fd: int, replaced: Callable[[], bool], poll_s: float) -> Iterator[bytes]:
    """The lines written to the FIFO until `replaced()` says it is no longer ours (checked
    every `poll_s` without input); a line longer than REQUEST_MAX is yielded cut, so that it is
    refused. rtrain starts each request with a newline, so a writer that left a line
    unfinished cannot spoil the next request."""
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], poll_s)
        if not ready:
            if replaced():
                return
            continue
        buf += os.read(fd, 4096)
        *lines, buf = buf.split(b"\n")
        yield from (ln for ln in lines if ln)
        if len(buf) > REQUEST_MAX:
            yield buf[:REQUEST_MAX]
            buf = b""


def is_request(line: bytes, token: str) -> bool:
    """A save-at-a-hang request with this attempt's token."""
    what, _, given = line.strip().partition(b" ")
    return what == CONTROL_FAILSAVE.encode() and hmac.compare_digest(given, token.encode())


class Refusals:
    """Requests without the attempt's token: each is logged, and reported to rtrain (a
    `control_refused` heartbeat, recorded as an event) at most every REFUSED_REPORT_S."""

    def __init__(self, path: Path, clock: Callable[[], float]) -> None:
        self.path, self.clock = path, clock
        self.count = 0
        self.reported_at = -math.inf

    def add(self) -> None:
        self.count += 1
        log.warning("refused a request on %s without this attempt's %s (%d so far)",
                    self.path, ENV_CONTROL_TOKEN, self.count)
        now = self.clock()
        if now - self.reported_at >= REFUSED_REPORT_S:
            self.reported_at = now
            runtime.heartbeat(event="control_refused",
                              reason=f"{self.count} request{'s' if self.count != 1 else ''} on "
                                     f"{self.path.name} without the attempt's token refused")


def save_all(checkpointers: Iterable[Any]) -> list[Path]:
    """The save at a hang for each Checkpointer; the committed paths."""
    saved = []
    with hold_steps:
        for c in checkpointers:
            path = c.save_on_failure(Hung("rtrain found the training process hung"))
            if path is not None:
                saved.append(path)
    runtime.heartbeat(event="hang_save_done",
                      reason=f"{len(saved)} checkpoint{'s' if len(saved) != 1 else ''} saved")
    return saved
