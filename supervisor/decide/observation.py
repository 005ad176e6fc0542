"""What the watch saw of one attempt: `Observation`, frozen, handed out once by proc/watch.py,
the one record of an attempt's end that classify, the policy and the records all read.

The watch records facts: the exit status, what the heartbeats said, the memory peaks, what it
did itself (a stop, the hang it found); the launch's features add what they found (the stuck
ranks at a hang). What those facts mean for classify (did the script get past start-up, did the
workers confirm their checkpoint, was a device lost) is read here, from the one value, by its
properties, so nothing after the watch writes to what it saw.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rtrain.supervisor.core.protocol import Heartbeat


@dataclass(frozen=True, kw_only=True)
class Heartbeats:
    """What the worker's heartbeats said over one attempt; `add` folds in one more."""

    count: int = 0
    last_event: str | None = None
    last_step: int | None = None
    last_loss: float | None = None
    samples_per_s: float | None = None
    max_step_interval: float | None = None
    settings: dict | None = None  # as last reported by the worker
    longest_save_s: float | None = None  # save_begin to save_end, by the worker's clock
    exception_at: float | None = None  # the first `exception` heartbeat's time (worker's clock)
    exception_peer_lost: bool = False  # that exception was a collective broken by a rank gone
    save_began: Mapping[int, float] = field(default_factory=dict)  # rank -> its save_begin
    # rank -> (pid, last step it named): matches a rank to its stack dump at a hang
    ranks: Mapping[int, tuple[int, int | None]] = field(default_factory=dict)
    world: int | None = None  # the group's size, as the ranks report it (torchrun)

    def add(self, hb: Heartbeat) -> Heartbeats:
        """These heartbeats and `hb`."""
        new: dict[str, Any] = {"count": self.count + 1, "last_event": hb.event}
        if hb.event == "save_begin":
            new["save_began"] = {**self.save_began, hb.rank: hb.time}
        elif hb.event == "save_end" and hb.rank in self.save_began:
            began = dict(self.save_began)
            took = max(0.0, hb.time - began.pop(hb.rank))
            new["save_began"] = began
            new["longest_save_s"] = max(took, self.longest_save_s or 0.0)
        elif hb.event == "exception" and self.exception_at is None:
            new["exception_at"] = hb.time
            new["exception_peer_lost"] = bool(hb.peer_lost)
        if hb.step is not None:
            new["last_step"] = hb.step
        known = self.ranks.get(hb.rank)
        if known is None or known[0] != hb.pid or (hb.step is not None and hb.event == "step"):
            step = hb.step if hb.event == "step" else (known[1] if known else None)
            new["ranks"] = {**self.ranks, hb.rank: (hb.pid, step)}
        if hb.world is not None:
            new["world"] = hb.world
        for name in ("loss", "samples_per_s", "max_step_interval", "settings"):
            value = getattr(hb, name)
            if value is not None:
                new["last_loss" if name == "loss" else name] = value
        return replace(self, **new)


@dataclass(frozen=True, kw_only=True)
class Observation:
    """What the watch saw of one attempt, from its spawn to its exit and the sweep after."""

    pid: int | None = None  # the child's pid, named in the reason sentence
    returncode: int | None = None  # as the OS reports it: negative when killed by that signal
    stderr_tail: str = ""
    exit_records: tuple[dict[str, Any], ...] = ()  # ExitRecord dicts, by rank
    last_step: int | None = None  # the newest step a heartbeat named
    heartbeats: Heartbeats = Heartbeats()  # what the heartbeats said, for the records
    duration_s: float = 0.0  # from the watch's start to the exit seen
    exited_at: float | None = None  # unix time the watch saw the child end
    # Memory, over the whole attempt.
    peak_rss_bytes: int = 0  # process tree
    host_mem_available_min: int | None = None  # lowest MemAvailable seen
    host_mem_total: int | None = None
    # what host pressure was measured against (the cgroup's limit or the machine's memory) at
    # the last sample; None before one
    host_mem_limit: int | None = None
    cgroup_oom_kills: int = 0  # increase of the oom_kill counter during the attempt
    gpu_mem_used_peak: int | None = None
    gpu_mem_total: int | None = None
    # What the watch found and did.
    pressure_stop: str | None = None  # why rtrain stopped the child under memory pressure
    gpu_lost: bool = False  # the GPU reader reported a device gone while the child ran
    gpu_detail: str = ""
    hang: bool = False  # the watch stopped it for silence
    hang_detail: str = ""
    hang_at: float | None = None  # unix time the hang was detected (before stacks are dumped)
    # At a hang: which rank is stuck and where (stuck/decide.py StuckReport.to_dict()), and the
    # NCCL flight recorder's dumps collected into the attempt dir (stuck/flight.py).
    stuck: Mapping[str, Any] | None = None
    flight_dumps: tuple[str, ...] = ()
    # the signal name that reached the supervisor, or the deadline's name ("the job's time
    # limit": the watch's stop_at), if any
    stop_requested: str | None = None
    signals: tuple[str, ...] = ()  # signals that reached the supervisor
    killed_after_grace: bool = False
    stop_s: float | None = None  # from the stop signal to the child's exit, when stopped
    leftovers: tuple[int, ...] = ()  # descendants still there after the sweep
    # After a failure: the devices' health checks that failed (DeviceHealth.to_dict()), and
    # what is wrong with them in words.
    failed_devices: tuple[dict[str, Any], ...] = ()
    failed_detail: str = ""
    # Whether the script got past start-up, when something other than these facts says so (a
    # table test); None: read from them (`first_step_seen`).
    started: bool | None = None

    def __post_init__(self) -> None:
        # A list given (a table test's) is kept as a tuple: the observation does not change.
        object.__setattr__(self, "exit_records", tuple(self.exit_records))

    @property
    def signal(self) -> str | None:
        """The signal that killed the child ("SIGKILL"), if one did."""
        rc = self.returncode
        if rc is None or rc >= 0:
            return None
        try:
            return _signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"

    @property
    def exit_code(self) -> int | None:
        """The child's exit code; None when a signal killed it (or it was never seen to end)."""
        return None if self.signal else self.returncode

    @property
    def first_step_seen(self) -> bool:
        """It got past start-up: a step heartbeat, or (a plain script, no heartbeats at all)
        a failure that was not an early start-up error."""
        if self.started is not None:
            return self.started
        return self.last_step is not None or (
            self.heartbeats.count == 0 and plain_script_started(
                duration_s=self.duration_s, stderr_tail=self.stderr_tail))

    @property
    def stop_confirmed(self) -> bool:
        """The worker said "checkpoint committed, stopping" (its last heartbeat)."""
        return self.heartbeats.last_event == "stop"

    @property
    def stuck_summary(self) -> str:
        """Which rank is stuck and where, at a hang (the stuck-ranks feature's report)."""
        return str(self.stuck["summary"]) if self.stuck else ""

    @property
    def device_lost(self) -> bool:
        """A device was lost while it ran, or failed its health checks after the failure."""
        return self.gpu_lost or bool(self.failed_devices)

    @property
    def device_detail(self) -> str:
        return "; ".join(filter(None, [self.gpu_detail, self.failed_detail]))

    @property
    def memory_limit(self) -> int | None:
        """What host memory pressure is measured against: the cgroup's limit, else the
        machine's memory."""
        return self.host_mem_limit or self.host_mem_total


# What a script that never got going prints: a broken import, a typo in the file, a bad flag.
STARTUP_ERROR = re.compile(
    r"SyntaxError|IndentationError|ModuleNotFoundError|ImportError|can't open file"
    r"|error: unrecognized arguments|error: the following arguments are required"
    r"|error: argument |No such file or directory")
STARTUP_WINDOW_S = 120.0


def plain_script_started(*, duration_s: float, stderr_tail: str) -> bool:
    """For a script without heartbeats: did it get past start-up?

    Without a step heartbeat there is no direct sign, so a failure counts as `startup` only when
    it came early and stderr shows a start-up error; any other failure is a crash, retried.
    """
    early = duration_s < STARTUP_WINDOW_S
    return not (early and STARTUP_ERROR.search(stderr_tail[-4096:]))
