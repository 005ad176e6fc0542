"""Watch one attempt until it ends: a single-threaded `selectors` loop.

Woken by: the child's pidfd (its exit, at once), its stdout/stderr (teed), heartbeat datagrams,
the signal wakeup fd, and timers (sampling, the hang deadline, `stop_at`: a stop the caller
planned, before the Slurm time limit; the end of a stop's grace). Nothing
here decides what the ending means: what it sees while the child runs it keeps to itself, and
once the child has exited (proc/watch_outcome.py: exit status, exit records, memory, the health
gate's readings after a failure) it hands out one frozen `Observation` in the `Outcome`;
decide/observation.py draws the evidence for classify from it.

At a hang the caller hears it first (`on_hang`: the stuck-ranks feature asks the NCCL flight
recorder for its dumps), then the stacks are dumped (proc/stacks.py) and the worker is asked to
save its last completed step.

Memory pressure (pressure/monitor.py) is judged at each sample: a relieve request to the
group first, then the ordinary stop, observed as `pressure_stop` for a rung down.

Stopping never blocks the loop (proc/watch_stop.py): the stop signal goes to the group, output
keeps being drained (a child saving a checkpoint must not block on a full pipe), and at the
grace's end the group gets SIGKILL. After the exit every remaining descendant is swept
(stop.sweep).
"""

from __future__ import annotations

import logging
import math
import selectors
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rtrain.supervisor.core.filemode import env_mode
from rtrain.supervisor.core.protocol import (
    DUMP_SIGNAL,
    ENV_CONTROL_TOKEN,
    RELIEVE_SIGNAL,
    Heartbeat,
)
from rtrain.supervisor.decide.observation import Heartbeats, Observation
from rtrain.supervisor.pressure.monitor import PressureNote, PressureWatch
from rtrain.supervisor.proc.control import ask_failure_save
from rtrain.supervisor.proc.gpu import GpuReader, GpuReading, NullReader
from rtrain.supervisor.proc.gpu_health import describe
from rtrain.supervisor.proc.heartbeat import HangClock, HangPolicy, HeartbeatReceiver
from rtrain.supervisor.proc.proctree import ProcTree, TreeSample
from rtrain.supervisor.proc.reaper import reap_orphans
from rtrain.supervisor.proc.signals import STOP_SIGNALS, SignalCatcher
from rtrain.supervisor.proc.spawn import Child
from rtrain.supervisor.proc.stacks import dump_stacks
from rtrain.supervisor.proc.stop import stop_group, sweep
from rtrain.supervisor.proc.watch_outcome import (
    OomCounter,
    Outcome,
    health_gate,
    host_total,
    read_exit_records,
)
from rtrain.supervisor.proc.watch_stop import Stopping, drain_pipes

if TYPE_CHECKING:
    from rtrain.supervisor.config import Config, PressureConfig

log = logging.getLogger(__name__)

_POLL_S = 0.05  # without a pidfd (kernel < 5.3) exits are noticed by polling this often
# The loop woke this much later than it asked to: the supervisor itself did not run (stopped
# with the job: Slurm's suspend stops every process of it), and the gap is excused.
NOT_RUNNING_S = 5.0


@dataclass(frozen=True, kw_only=True)
class WatchConfig:
    """How one attempt is watched. The settings among these have no defaults here:
    `from_config` takes them from `config.Config`, which owns their names, defaults and
    meaning. The rest are not settings; their defaults below are their only definition."""

    stop_signal: int
    """Sent to the child's group to ask for "save at the next step boundary and exit 75"."""
    grace_s: float
    """From the stop signal to SIGKILL, when a signal reached the supervisor."""
    sample_interval_s: float
    """Process tree, host memory and GPU sampling period."""
    hang: HangPolicy
    """When silence means the child is stuck (`[hang]`)."""
    pressure: PressureConfig
    """When memory pressure asks for relief, then for a stop and a rung down (`[pressure]`)."""
    hang_grace_s: float
    """From the stop signal to SIGKILL for a hung child or a lost GPU (`[hang] grace_s`)."""
    dump_signal: int = signal.Signals[DUMP_SIGNAL]
    """RTRAIN_DUMP_SIGNAL: the worker's faulthandler writes its stacks on it."""
    relieve_signal: int = signal.Signals[RELIEVE_SIGNAL]
    """RTRAIN_RELIEVE_SIGNAL: memory pressure, the worker frees what it can."""
    dump_timeout_s: float = 10.0
    """Bound on collecting stacks of a hung child."""
    sweep_confirm_s: float = 2.0
    """Bound on waiting for swept descendants to disappear."""

    def __post_init__(self) -> None:
        if self.grace_s < 0 or self.hang_grace_s < 0:
            raise ValueError("grace must be zero or more seconds")
        if self.sample_interval_s <= 0:
            raise ValueError("sample_interval_s must be positive")

    @classmethod
    def from_config(cls, config: Config) -> WatchConfig:
        """What `rtrain launch` watches with: the stop signal, grace, sampling, `[hang]` and
        `[pressure]`."""
        return cls(stop_signal=signal.Signals[config.stop_signal], grace_s=config.grace_s,
                   hang_grace_s=config.hang.grace_s, sample_interval_s=config.sample_interval_s,
                   hang=HangPolicy.from_config(config.hang), pressure=config.pressure)


@dataclass(frozen=True)
class Sample:
    tree: TreeSample
    gpu: GpuReading


def watch(
    child: Child,
    config: WatchConfig,
    *,
    heartbeats: HeartbeatReceiver | None = None,
    gpu: GpuReader | None = None,
    signals: SignalCatcher | None = None,
    tree: ProcTree | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_heartbeat: Callable[[Heartbeat], None] | None = None,
    on_sample: Callable[[Sample], None] | None = None,
    stop_at: float | None = None,
    stop_why: str = "a deadline",
    on_pressure: Callable[[PressureNote], None] | None = None,
    on_hang: Callable[[], None] | None = None,
) -> Outcome:
    """Watch `child` until it has exited and its descendants are swept; never raises for what the
    child does. Pass `signals` to keep one catcher across attempts (the launch loop); without it
    one is installed for this call (main thread only). At `stop_at` (on `clock`) the child is
    stopped as on a stop signal, `stop_why` naming the stop (the job's time limit).
    `on_pressure` hears pressure rising (once an attempt, before anything is asked of the
    child), each relieve request and the stop for a rung down (pressure/monitor.py).
    `on_hang` hears a hang found, before the stacks are dumped (the flight recorder's request)."""
    w = _Watch(child, config, heartbeats, gpu or NullReader(), tree or ProcTree(), clock)
    w.on_heartbeat, w.on_sample, w.on_pressure = on_heartbeat, on_sample, on_pressure
    w.on_hang = on_hang
    w.stop_at, w.stop_why = (math.inf if stop_at is None else stop_at), stop_why
    if signals is not None:
        return w.run(signals)
    with SignalCatcher(STOP_SIGNALS) as own:
        return w.run(own)


class _Watch:
    def __init__(self, child, config, heartbeats, gpu, tree, clock) -> None:
        self.child, self.config, self.hbs = child, config, heartbeats
        self.gpu, self.tree, self.clock = gpu, tree, clock
        if heartbeats is not None:
            # Heard from now on: this child, its descendants, and whoever has its token.
            heartbeats.attempt(child.pid, child.spec.env.get(ENV_CONTROL_TOKEN))
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None
        self.on_sample: Callable[[Sample], None] | None = None
        self.on_pressure: Callable[[PressureNote], None] | None = None
        self.on_hang: Callable[[], None] | None = None
        self.heartbeats = Heartbeats()
        # What the watch found and did, handed out in the Observation.
        self.stop_requested: str | None = None  # the stop signal's name, or the deadline's
        self.hung: tuple[str, float] | None = None  # why, and the unix time it was found
        self.gpu_lost: str | None = None  # the reader's detail
        self.gpu_peak: tuple[int, int] | None = None  # used, total of the fullest reading
        self.pressure_stop: str | None = None
        self.t0 = clock()
        self.hang = HangClock(config.hang, self.t0)
        self.stop = Stopping(child, config.stop_signal)
        self.stop_at, self.stop_why = math.inf, ""  # a deadline's stop (watch's stop_at)
        self.exited_at: float | None = None
        self.exited_wall: float | None = None  # unix time: compared with the worker's clock
        self.stack_files: list[Path] = []
        self.hang_save_asked = False  # a reader took the request to save at the hang
        self.oom = OomCounter.start(child)
        self.pressure = PressureWatch(child, config.pressure, self.oom.group,
                                      config.relieve_signal, config.sample_interval_s)

    def run(self, signals: SignalCatcher) -> Outcome:
        sel = self._selector(signals)
        c = self.child
        # The first sample waits a moment: it would compete with the child's start-up for the CPU,
        # and a child that dies at once leaves its evidence in the exit status and stderr.
        next_sample = self.clock() + min(0.25, self.config.sample_interval_s)
        exited = False
        try:
            while not exited:
                now = self.clock()
                if now >= next_sample:
                    self._sample(now)
                    next_sample = now + self.config.sample_interval_s
                hang_at = math.inf if self.stop.active else self.hang.deadline()
                stop_at = math.inf if self.stop.active else self.stop_at
                wake = min(next_sample, hang_at, stop_at, self.stop.deadline())
                timeout = max(0.0, wake - now)
                if c.pidfd is None:
                    timeout = min(timeout, _POLL_S)
                asked = now + timeout
                for key, _ in sel.select(timeout):
                    if key.data == "exit":
                        exited = True
                    else:
                        self._dispatch(sel, key.data, signals)
                if c.pidfd is None:
                    exited = c.returncode is not None
                now = self.clock()
                if now - asked >= NOT_RUNNING_S:
                    self._not_running(now, now - asked)
                if exited:
                    self.exited_at, self.exited_wall = now, time.time()
                    continue
                if now >= stop_at and not self.stop.active:  # a signal may have come first
                    self._deadline(now)
                if now >= hang_at or now >= self.stop.deadline():
                    self._timers(now)
            c.popen.wait()  # reap: it has exited, this returns at once
        except BaseException:
            # A failing callback (or a bug here) must not leave training running unwatched.
            log.error("watch failed; stopping the training process group")
            stop_group(c, self.config.stop_signal, self.config.hang_grace_s, tree=self.tree)
            raise
        finally:
            sel.close()
        return self._finish()

    def _selector(self, signals: SignalCatcher) -> selectors.BaseSelector:
        """What wakes the loop: the exit (pidfd), output, heartbeats, signals."""
        sel = selectors.DefaultSelector()
        c = self.child
        if c.pidfd is not None:
            sel.register(c.pidfd, selectors.EVENT_READ, "exit")
        for pipe in (c.stdout, c.stderr):
            if not pipe.closed:
                sel.register(pipe.fd, selectors.EVENT_READ, pipe)
        if self.hbs is not None:
            sel.register(self.hbs.fileno(), selectors.EVENT_READ, "heartbeat")
        if signals.fileno() is not None:
            sel.register(signals.fileno(), selectors.EVENT_READ, "signal")
        return sel

    def _not_running(self, now: float, gap: float) -> None:
        """The supervisor itself was stopped (or starved) for the `gap` s before `now`: the
        child's silence starts afresh, and a running stop's grace moves on by the gap."""
        log.warning("rtrain did not run for %.1f s (stopped with the job, e.g. a suspended Slurm "
                    "job): the training process's silence counts from now", gap)
        self.hang.excuse(now, gap)
        if self.stop.active:
            self.stop.extend(self.stop.deadline() + gap)

    def _dispatch(self, sel: selectors.BaseSelector, what: object, signals: SignalCatcher) -> None:
        now = self.clock()
        if what == "heartbeat":
            self._heartbeats(now)
        elif what == "signal":
            for sig in signals.take():
                self._signal(sig, now)
        else:  # an output pipe
            if not what.pump():  # type: ignore[attr-defined]
                sel.unregister(what.fd)  # type: ignore[attr-defined]
            self.hang.activity(now)

    def _heartbeats(self, now: float) -> None:
        assert self.hbs is not None
        for hb in self.hbs.drain():
            if hb.event == "control_refused":
                # The worker's FIFO thread reporting someone else's writes: neither progress
                # nor a word on how the attempt ends (a `stop` before it still confirms).
                if self.on_heartbeat is not None:
                    self.on_heartbeat(hb)
                continue
            self.hang.heartbeat(hb, now)
            self.heartbeats = self.heartbeats.add(hb)
            self.pressure.heartbeat(hb, now)
            if hb.event == "save_begin" and self.hang_save_asked and self.stop.active:
                # The save at the hang has begun: it gets the time any save gets (a large
                # model, a slow disk), not the hung child's grace; it is bounded in the worker.
                self.stop.extend(now + self.config.hang.save_allowance_s)
            if hb.event == "hang_save_done" and self.hung and self.stop.active:
                self.stop.kill_now(now)  # its save at the hang is done: nothing to wait for
            if self.on_heartbeat is not None:
                self.on_heartbeat(hb)

    def _signal(self, sig: int, now: float) -> None:
        name = self.stop.received(sig, now)
        if name is not None and self.stop_requested is None:
            self.stop_requested = name
            self.stop.begin(now, self.config.grace_s)

    def _deadline(self, now: float) -> None:
        """The deadline passed: stop exactly as on a stop signal (save, exit 75, the grace)."""
        log.warning("stopping the training process: %s", self.stop_why)
        if self.stop_requested is None:
            self.stop_requested = self.stop_why
        self.stop.begin(now, self.config.grace_s)

    def _timers(self, now: float) -> None:
        self.stop.kill_if_due(now)
        if not self.stop.active:
            why = self.hang.check(now)
            if why is not None and self.child.returncode is None:
                self._on_hang(why)

    def _on_hang(self, why: str) -> None:
        log.warning("training process hung: %s; collecting stacks", why)
        self.hung = why, time.time()
        if self.on_hang is not None:
            self.on_hang()
        pids = [p.pid for p in self.tree.live()]
        self.stack_files = dump_stacks(
            pids, self.child.spec.attempt_dir, self.config.dump_signal, self.config.dump_timeout_s,
            env_mode(self.child.spec.env))
        # Stuck before its optimizer step, the worker still holds the last completed step: a
        # thread of its own saves it within the grace (worker/saving/hang_save.py).
        self.hang_save_asked = ask_failure_save(
            self.child.spec.attempt_dir, self.child.spec.env.get(ENV_CONTROL_TOKEN))
        if self.hang_save_asked:
            log.warning("asked the hung process to save its last completed step")
        self.stop.begin(self.clock(), self.config.hang_grace_s)

    def _sample(self, now: float) -> None:
        reap_orphans()  # adopted orphans that exited since the last sample (PID 1 in a container)
        tree = self.tree.sample(now)
        if tree.cpu_progress:
            self.hang.activity(now)
        reading = self.gpu.read(tree.pids) if self.gpu.available else GpuReading()
        for dev in reading.devices:
            if self.gpu_peak is None or dev.used > self.gpu_peak[0]:
                self.gpu_peak = dev.used, dev.total
        if reading.lost and self.gpu_lost is None:
            log.warning("GPU lost: %s", reading.detail)
            self.gpu_lost = reading.detail
            self.stop.begin(now, self.config.hang_grace_s)
        self._pressure(now, tree, reading)
        if self.on_sample is not None:
            self.on_sample(Sample(tree, reading))

    def _pressure(self, now: float, tree: TreeSample, reading: GpuReading) -> None:
        note = self.pressure.sample(now, tree, reading)
        if note is None:
            return
        if note.action == "rising":  # nothing asked of the child: the caller may make room
            if self.on_pressure is not None:
                self.on_pressure(note)
            return
        if note.action == "degrade":
            if self.stop.active:  # stopping anyway (a signal, a hang): that reason stands
                return
            # The ordinary stop: the worker saves at its next step boundary and exits 75;
            # pressure_stop makes that ending a memory failure, one rung down.
            self.pressure_stop = note.why or note.reading.describe()
            self.stop.begin(now, self.config.grace_s)
        if self.on_pressure is not None:
            self.on_pressure(note)

    def _finish(self) -> Outcome:
        c, now = self.child, self.clock()
        for pipe in (c.stdout, c.stderr):
            pipe.pump()
        if self.hbs is not None:
            self._heartbeats(now)  # the last ones (e.g. "stop") arrive just before the exit
        swept, leftovers = sweep(c, self.tree, confirm_s=self.config.sweep_confirm_s)
        drain_pipes(c)
        failed = health_gate(self.gpu) if c.returncode != 0 and not self.stop_requested else ()
        hang_detail, hang_at = self.hung or ("", None)
        used, total = self.gpu_peak or (None, None)
        seen = Observation(
            pid=c.pid, returncode=c.returncode, stderr_tail=c.stderr.tail_text(),
            exit_records=tuple(read_exit_records(c.spec.attempt_dir)),
            last_step=self.heartbeats.last_step, heartbeats=self.heartbeats,
            duration_s=now - self.t0,
            exited_at=self.exited_wall if self.exited_wall is not None else time.time(),
            peak_rss_bytes=self.tree.peak_rss, host_mem_available_min=self.tree.min_available,
            host_mem_total=host_total(), host_mem_limit=self.pressure.host_limit,
            cgroup_oom_kills=self.oom.since_start() or 0,
            gpu_mem_used_peak=used, gpu_mem_total=total, pressure_stop=self.pressure_stop,
            gpu_lost=self.gpu_lost is not None, gpu_detail=self.gpu_lost or "",
            hang=self.hung is not None, hang_detail=hang_detail, hang_at=hang_at,
            stop_requested=self.stop_requested, signals=tuple(self.stop.signals_seen),
            killed_after_grace=self.stop.killed_after_grace,
            stop_s=self.stop.took(self.exited_at if self.exited_at is not None else now),
            leftovers=tuple(leftovers),
            failed_devices=tuple(h.to_dict() for h in failed),
            failed_detail=describe(list(failed)) if failed else "")
        return Outcome(seen=seen, hard_stop=self.stop.hard_stop,
                       stop=self.stop.result(swept, leftovers, duration_s=self.clock() - now),
                       pids_seen=sorted(self.tree.seen), stack_files=self.stack_files)
