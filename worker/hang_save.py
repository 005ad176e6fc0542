"""Save at a hang: serve the supervisor's request while the training thread is stuck.

When rtrain finds the process hung (no output, no heartbeat, no CPU progress for the hang
timeout) the training thread is blocked: in a data loader that stopped delivering, in a
collective, on a dead filesystem. If it blocked before the step's optimizer step, the model and
optimizer in memory are still the last completed step's, as for a crash in the forward
(worker/failsave.py). Signals cannot reach that thread (a Python handler runs on the main thread
only, between bytecodes), so the request comes through a FIFO, `control` in the attempt's status
dir, which a daemon thread of this module reads. On `failsave` it runs the same save at the
failure for every watched Checkpointer, with `Hung` as the exception, then sends a
`hang_save_done` heartbeat so that rtrain stops waiting for the grace.

Consistency: the save is decided and written with the marks of worker/failsave.py; an
optimizer step that starts meanwhile (the thread was slow, not hung) waits in its pre-hook until
the save ends (`hold_steps`), so the step's own writes never overlap the save's reads.

Only one process per status dir serves it: never under torch.distributed (a save there needs
every rank; the failure save declines it anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from supervisor.protocol import CONTROL_FAILSAVE, CONTROL_FIFO, ENV_STATUS
from worker import runtime

log = logging.getLogger(__name__)

hold_steps = threading.Lock()
"""Held while a save at a hang runs; an optimizer step's pre-hook waits on it."""


class Hung(Exception):
    """What the save at a hang records as the failure (`failure` in the manifest's info)."""


_started = False


def start(checkpointers: Callable[[], Iterable[Any]]) -> bool:
    """Create the FIFO and its reader thread once per process (run by rtrain, one process).
    `checkpointers` lists those that save at a failure. Whether it serves."""
    global _started
    status = os.environ.get(ENV_STATUS)
    if _started or not status or int(os.environ.get("WORLD_SIZE") or 1) > 1:
        return False
    path = Path(status) / CONTROL_FIFO
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a FIFO left by an earlier process of this attempt dir
        os.mkfifo(path, 0o600)
    except OSError as e:
        log.warning("no save at a hang: cannot create %s (%s)", path, e.strerror)
        return False
    _started = True
    threading.Thread(target=_serve, args=(path, checkpointers), name="rtrain-hang-save",
                     daemon=True).start()
    return True


def _serve(path: Path, checkpointers: Callable[[], Iterable[Any]]) -> None:
    while True:
        try:
            # Blocks until rtrain opens it for writing; reads until it closes.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)
                return
            with os.fdopen(fd, "rb") as f:
                request = f.read(64)
        except OSError as e:
            log.warning("save at a hang no longer served: %s", e)
            return
        if CONTROL_FAILSAVE.encode() in request:
            save_all(checkpointers())


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
