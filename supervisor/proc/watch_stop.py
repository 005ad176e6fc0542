"""The stop path of a watched attempt, without blocking the watch loop.

A stop sends the stop signal to the child's group and sets a deadline; the loop keeps draining
output meanwhile (a child saving a checkpoint must not block on a full pipe) and calls
`kill_if_due`, which sends SIGKILL to the group at the grace's end. A second SIGINT is a hard
stop: SIGKILL at once. After the exit and the sweep (stop.sweep), `drain_pipes` reads the output
that is left. Nothing here writes the Observation: the watch records what these report.
"""

from __future__ import annotations

import logging
import math
import selectors
import signal
import time

from rtrain.supervisor.proc.spawn import Child
from rtrain.supervisor.proc.stop import StopResult, signal_group

log = logging.getLogger(__name__)

_DRAIN_S = 0.5  # after the sweep, how long to wait for the pipes' EOF


class Stopping:
    """One attempt's stop: which signals arrived, what was sent, when the grace ends."""

    def __init__(self, child: Child, stop_signal: int) -> None:
        self.child, self.stop_signal = child, stop_signal
        self.active = False
        self.began_at: float | None = None  # when the stop signal was sent
        self.kill_at: float | None = None  # end of the running stop's grace
        self.killed_after_grace = False
        self.signal_sent: str | None = None
        self.signals_seen: list[str] = []
        self.hard_stop = False

    def received(self, sig: int, now: float) -> str | None:
        """Note a signal that reached the supervisor; its name, or None for a second SIGINT,
        which kills the group at the next timer instead of waiting for a save."""
        name = signal.Signals(sig).name
        self.signals_seen.append(name)
        if sig == signal.SIGINT and self.signals_seen.count("SIGINT") > 1:
            log.warning("second SIGINT: killing the training process group now")
            self.hard_stop = True
            self.kill_at = now
            return None
        return name

    def begin(self, now: float, grace_s: float) -> None:
        """The stop signal to the group, SIGKILL `grace_s` later (a running stop keeps its
        deadline)."""
        if self.active:
            return
        self.active, self.began_at = True, now
        if signal_group(self.child, self.stop_signal):
            self.signal_sent = signal.Signals(self.stop_signal).name
        self.kill_at = now + grace_s

    def took(self, exited_at: float) -> float | None:
        """Seconds from the stop signal to the child's exit; None without a stop."""
        return None if self.began_at is None else max(0.0, exited_at - self.began_at)

    def kill_now(self, now: float) -> None:
        """End the running stop's grace now (the group is killed at the next timer)."""
        if self.kill_at is not None:
            self.kill_at = min(self.kill_at, now)

    def extend(self, until: float) -> None:
        """Move the running stop's SIGKILL to `until` if that is later."""
        if self.kill_at is not None and not self.hard_stop:
            self.kill_at = max(self.kill_at, until)

    def deadline(self) -> float:
        return math.inf if self.kill_at is None else self.kill_at

    def kill_if_due(self, now: float) -> None:
        if self.kill_at is not None and now >= self.kill_at and self.child.returncode is None:
            self.killed_after_grace = not self.hard_stop
            signal_group(self.child, signal.SIGKILL)
            self.kill_at = None

    def result(self, swept: list[int], leftovers: list[int], duration_s: float) -> StopResult:
        return StopResult(
            returncode=self.child.returncode,
            signal_sent=self.signal_sent,
            killed_after_grace=self.killed_after_grace,
            swept=swept,
            leftovers=leftovers,
            duration_s=duration_s,
        )


def drain_pipes(child: Child) -> None:
    """Read the child's pipes to EOF, then close them."""
    # Everyone that could hold the write ends is dead now, so EOF comes at once.
    deadline = time.monotonic() + _DRAIN_S
    pipes = [p for p in (child.stdout, child.stderr) if not p.closed]
    with selectors.DefaultSelector() as sel:
        for pipe in pipes:
            sel.register(pipe.fd, selectors.EVENT_READ, pipe)
        while sel.get_map() and time.monotonic() < deadline:
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                if not key.data.pump():
                    sel.unregister(key.fd)
    for pipe in pipes:
        pipe.close()
