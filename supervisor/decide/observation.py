"""What the watch saw of one attempt (`Observation`, frozen, handed out once by proc/watch.py),
and the `Evidence` classify reads, drawn from it here (`evidence`).

The watch records facts: the exit status, what the heartbeats said, the memory peaks, what it
did itself (a stop, the hang it found). What those facts mean for classify (did the script get
past start-up, did the workers confirm their checkpoint, was a device lost) is decided here, from
the one value, so nothing after the watch writes to what it saw.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.classify import plain_script_started
from rtrain.supervisor.decide.failures import Evidence


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


def evidence(seen: Observation) -> Evidence:
    """What classify reads of an attempt: the facts, and what they say about start-up, the
    workers' stop, the devices and the memory limit."""
    rc = seen.returncode
    signal = _signal.Signals(-rc).name if rc is not None and rc < 0 else None
    hb = seen.heartbeats
    # Without a step heartbeat: a plain script (no heartbeats at all), or one that died before
    # its first step.
    started = seen.last_step is not None or (
        hb.count == 0 and plain_script_started(duration_s=seen.duration_s,
                                               stderr_tail=seen.stderr_tail))
    return Evidence(
        returncode=rc if signal is None else None, signal=signal,
        pid=seen.pid, exit_records=seen.exit_records, stderr_tail=seen.stderr_tail,
        first_step_seen=started, last_step=seen.last_step,
        peak_rss_bytes=seen.peak_rss_bytes, host_mem_available_min=seen.host_mem_available_min,
        host_mem_total=seen.host_mem_total, cgroup_oom_kills=seen.cgroup_oom_kills,
        host_mem_limit=seen.host_mem_limit or seen.host_mem_total,
        gpu_mem_used_peak=seen.gpu_mem_used_peak, gpu_mem_total=seen.gpu_mem_total,
        pressure_stop=seen.pressure_stop,
        gpu_lost=seen.gpu_lost or bool(seen.failed_devices),
        gpu_detail="; ".join(filter(None, [seen.gpu_detail, seen.failed_detail])),
        hang=seen.hang, hang_detail=seen.hang_detail, hang_at=seen.hang_at,
        stuck_summary=str(seen.stuck["summary"]) if seen.stuck else "",
        stop_requested=seen.stop_requested, stop_confirmed=hb.last_event == "stop",
        killed_after_grace=seen.killed_after_grace, duration_s=seen.duration_s)
