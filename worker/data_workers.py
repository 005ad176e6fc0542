"""Stop signals inside DataLoader workers: left to the training process, which saves.

A stop often reaches every process of the group or job (rtrain's stop to the child's group,
Ctrl-C, Slurm's --signal, a container's SIGTERM). torch's worker dies of a SIGTERM its parent
did not send, and the loader then raises "DataLoader worker is killed" in the training loop
instead of the step boundary saving. A watched loader's `worker_init_fn` is wrapped with
`worker_init` (worker/data_iter.py) so that its workers leave such stops to the training process.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# Signals that ask the training process to save and stop (worker/runtime.py).
_STOP_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _ignore(signum: int, frame: Any) -> None:
    """A handler that does nothing: unlike SIG_IGN it does not outlive an exec."""


def worker_init(user_init: Any, worker_id: int) -> None:
    """In each DataLoader worker: leave stop signals to the training process, then call the
    user's `worker_init_fn`, if any.

    A SIGTERM from the training process (the loader ending its workers, multiprocessing's
    terminate at exit) still ends the worker at once, as torch's handler does; one from anyone
    else is left to the training process. Python handlers do not see the sender, so SIGTERM is
    blocked and taken by a thread."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_sigterm_from_parent_only, args=(parent,), daemon=True,
                     name="rtrain-worker-sigterm").start()
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _ignore)
    if user_init is not None:
        user_init(worker_id)


def _sigterm_from_parent_only(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent or os.getppid() != parent:
            os._exit(0)
