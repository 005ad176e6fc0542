"""Stop signals inside DataLoader workers: left to the training process, which saves.

A stop often reaches every process of the group or job (rtrain's stop to the child's group, Ctrl-C,
Slurm's --signal, a container's SIGTERM). torch's worker dies of a SIGTERM its parent did not send,
and the loader then raises "DataLoader worker is killed" in the training loop instead of the step
boundary saving. A watched loader's `worker_init_fn` is wrapped with `worker_init`
(worker/data/data_iter.py) so that its workers leave such stops to the training process, and they
are forked with SIGTERM blocked (`born_with_sigterm_blocked`), so that no stop reaches one in its
start-up before that.

The same thread ends a worker whose training process is gone. torch's own watchdog notes the
worker's parent only after `worker_init_fn` returns: a worker still starting when the training
process died (killed right after the first batch of a fresh iterator, which the other worker
delivered) takes init's new parent for it and waits for work forever, holding what it inherited
open (the training process's stdout and stderr: whoever reads them to EOF waits with it).
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

# Signals that ask the training process to save and stop (worker/runtime.py).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# How often a worker looks whether its training process is gone: twice torch's own interval, so
# that its watchdog, which exits cleanly (removing the worker's temp dir), usually goes first.
ORPHAN_CHECK_S = 10.0


def _ignore(signum: int, frame: Any) -> None:
    """A handler that does nothing: unlike SIG_IGN it does not outlive an exec."""


def worker_init(user_init: Any, worker_id: int) -> None:
    """In each DataLoader worker: leave stop signals to the training process, then call the
    user's `worker_init_fn`, if any.

    A SIGTERM from the training process (the loader ending its workers, multiprocessing's
    terminate at exit) still ends the worker at once, as torch's handler does; one from anyone
    else is left to the training process. Python handlers do not see the sender, so SIGTERM is
    blocked and taken by a thread."""
    parent = _parent()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_sigterm_from_parent_only, args=(parent,), daemon=True,
                     name="rtrain-worker-sigterm").start()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _ignore)
    if user_init is not None:
        user_init(worker_id)


@contextlib.contextmanager
def born_with_sigterm_blocked(loader: Any) -> Iterator[None]:
    """Around `iter(loader)`, which forks the workers of a fresh iterator: they are born with
    SIGTERM blocked, as `worker_init` keeps it. torch's worker installs its SIGTERM handler (which
    dies of a SIGTERM its parent did not send) before it calls `worker_init_fn`; a stop sent to
    the whole group in between would end the worker, not leave it to the training process. A
    SIGTERM meant for the training process meanwhile waits the few milliseconds of the fork."""
    init = getattr(loader, "worker_init_fn", None)
    if not (isinstance(init, functools.partial) and init.func is worker_init):
        yield  # workers without worker_init would keep it blocked and never end on terminate()
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _parent() -> int:
    """The pid of this worker's parent while the training process lives: the training process,
    which forked or spawned it, noted before it started (`os.getppid()` is already init's when the
    training process died first); under forkserver the server, this worker's parent from the
    start."""
    made_by = multiprocessing.parent_process()
    method = (getattr(multiprocessing.current_process(), "_start_method", None)
              or multiprocessing.get_start_method(allow_none=True))
    if made_by is None or made_by.pid is None or method == "forkserver":
        return os.getppid()
    return made_by.pid


def _gone(parent: int) -> bool:
    """Whether the training process is gone: this worker was reparented, or the parent is dead
    but not yet fully exited (a zombie leader whose last thread is still leaving; its children
    are reparented only when that thread has gone too)."""
    if os.getppid() != parent:
        return True
    try:
        with open(f"/proc/{parent}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False  # no /proc: the reparenting alone tells
    return state in (b"Z", b"X")


def _sigterm_from_parent_only(parent: int) -> None:
    while True:
        # First at once: the parent may have died before this worker began (see the module's doc).
        if _gone(parent):
            os._exit(0)
        info = signal.sigtimedwait({signal.SIGTERM}, ORPHAN_CHECK_S)
        if info is not None and info.si_pid == parent:
            os._exit(0)
