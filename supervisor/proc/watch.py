"""Watch one attempt until it ends: a single-threaded `selectors` loop.

Woken by: the child's pidfd (its exit, at once), its stdout/stderr (teed), heartbeat datagrams,
the signal wakeup fd, and timers (sampling, the hang deadline, the end of a stop's grace). Nothing
here decides what the ending means; it gathers `Evidence` for classify and returns it finished:
this module is the only writer of an attempt's Evidence (including the health gate's verdict on
the devices after a failure), and everyone after it only reads.

Stopping never blocks the loop: the stop signal goes to the group, output keeps being drained
(a child saving a checkpoint must not block on a full pipe), and at the grace's end the group
gets SIGKILL. After the exit every remaining descendant is swept (stop.sweep).
"""

from __future__ import annotations

import logging
import math
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.decide.classify import plain_script_started
from supervisor.decide.failures import Evidence
from supervisor.proc.cgroup import MemoryCgroup, memory_cgroup
from supervisor.proc.gpu import GpuReader, GpuReading, NullReader
from supervisor.proc.gpu_health import DeviceHealth, describe, problems
from supervisor.proc.heartbeat import HangClock, HangPolicy, HeartbeatReceiver
from supervisor.proc.proctree import ProcTree, TreeSample
from supervisor.proc.spawn import Child
from supervisor.proc.stacks import dump_stacks
from supervisor.proc.stop import StopResult, signal_group, stop_group, sweep
from supervisor.protocol import DUMP_SIGNAL, ExitRecord, Heartbeat

if TYPE_CHECKING:
    from supervisor.config import Config

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_POLL_S = 0.05  # without a pidfd (kernel < 5.3) exits are noticed by polling this often
_DRAIN_S = 0.5  # after the sweep, how long to wait for the pipes' EOF


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
    hang_grace_s: float = 15.0
    """From the stop signal to SIGKILL for a hung child or a lost GPU (it will not save)."""
    dump_signal: int = signal.Signals[DUMP_SIGNAL]
    """RTRAIN_DUMP_SIGNAL: the worker's faulthandler writes its stacks on it."""
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
        """What `rtrain launch` watches with: the stop signal, grace, sampling and `[hang]`."""
        return cls(stop_signal=signal.Signals[config.stop_signal], grace_s=config.grace_s,
                   sample_interval_s=config.sample_interval_s,
                   hang=HangPolicy.from_config(config.hang))


@dataclass(frozen=True)
class Sample:
    tree: TreeSample
    gpu: GpuReading


@dataclass
class HeartbeatSummary:
    count: int = 0
    last_event: str | None = None
    last_step: int | None = None
    last_loss: float | None = None
    samples_per_s: float | None = None
    max_step_interval: float | None = None
    settings: dict | None = None  # as last reported by the worker


@dataclass
class Outcome:
    evidence: Evidence
    heartbeats: HeartbeatSummary
    stop: StopResult  # escalation and sweep: what was killed, what is left
    signals: list[str] = field(default_factory=list)  # signals that reached the supervisor
    hard_stop: bool = False  # a second SIGINT: SIGKILL at once, no grace
    pids_seen: list[int] = field(default_factory=list)  # for wait_gpu_released
    stack_files: list[Path] = field(default_factory=list)
    failed_devices: tuple[DeviceHealth, ...] = ()  # the health gate's failed readings


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
) -> Outcome:
    """Watch `child` until it has exited and its descendants are swept; never raises for what the
    child does. Pass `signals` to keep one catcher across attempts (the launch loop); without it
    one is installed for this call (main thread only)."""
    w = _Watch(child, config, heartbeats, gpu or NullReader(), tree or ProcTree(), clock)
    w.on_heartbeat, w.on_sample = on_heartbeat, on_sample
    if signals is not None:
        return w.run(signals)
    with SignalCatcher(STOP_SIGNALS) as own:
        return w.run(own)


class _Watch:
    def __init__(self, child, config, heartbeats, gpu, tree, clock) -> None:
        self.child, self.config, self.hbs = child, config, heartbeats
        self.gpu, self.tree, self.clock = gpu, tree, clock
        self.on_heartbeat: Callable[[Heartbeat], None] | None = None
        self.on_sample: Callable[[Sample], None] | None = None
        self.ev = Evidence(pid=child.pid)
        self.summary = HeartbeatSummary()
        self.t0 = clock()
        self.hang = HangClock(config.hang, self.t0)
        self.kill_at: float | None = None  # end of the running stop's grace
        self.stopping = False
        self.killed_after_grace = False
        self.signal_sent: str | None = None
        self.signals_seen: list[str] = []
        self.hard_stop = False
        self.stack_files: list[Path] = []
        self.cgroup, self.oom_base = self._cgroup()

    def _cgroup(self) -> tuple[MemoryCgroup | None, int | None]:
        spec_dir = self.child.spec.cgroup_dir
        if spec_dir is not None:
            group = MemoryCgroup(spec_dir, 1 if (spec_dir / "memory.oom_control").exists() else 2)
        else:  # a fast-dying child is already gone: it was in ours
            group = memory_cgroup(self.child.pid) or memory_cgroup(os.getpid())
        return group, group.oom_kills() if group else None

    def run(self, signals: SignalCatcher) -> Outcome:
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
                hang_at = math.inf if self.stopping else self.hang.deadline()
                wake = min(next_sample, hang_at, self.kill_at or math.inf)
                timeout = max(0.0, wake - now)
                if c.pidfd is None:
                    timeout = min(timeout, _POLL_S)
                for key, _ in sel.select(timeout):
                    if key.data == "exit":
                        exited = True
                    else:
                        self._dispatch(sel, key.data, signals)
                if c.pidfd is None:
                    exited = c.returncode is not None
                now = self.clock()
                if not exited and (now >= hang_at or now >= (self.kill_at or math.inf)):
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

    def _dispatch(self, sel: selectors.BaseSelector, what: object, signals: SignalCatcher) -> None:
        now = self.clock()
        if what == "heartbeat":
            self._heartbeats(now)
        elif what == "signal":
            for sig in signals.take():
                self._signal(sig, now)
        else:  # an output pipe
            if not what.pump(now):  # type: ignore[attr-defined]
                sel.unregister(what.fd)  # type: ignore[attr-defined]
            self.hang.activity(now)

    def _heartbeats(self, now: float) -> None:
        assert self.hbs is not None
        for hb in self.hbs.drain():
            self.hang.heartbeat(hb, now)
            s = self.summary
            s.count += 1
            s.last_event = hb.event
            if hb.step is not None:
                s.last_step = hb.step
                self.ev.first_step_seen = True
                self.ev.last_step = hb.step
            for name in ("loss", "samples_per_s", "max_step_interval", "settings"):
                value = getattr(hb, name)
                if value is not None:
                    setattr(s, "last_loss" if name == "loss" else name, value)
            if self.on_heartbeat is not None:
                self.on_heartbeat(hb)

    def _signal(self, sig: int, now: float) -> None:
        name = signal.Signals(sig).name
        self.signals_seen.append(name)
        if sig == signal.SIGINT and self.signals_seen.count("SIGINT") > 1:
            log.warning("second SIGINT: killing the training process group now")
            self.hard_stop = True
            self.kill_at = now
            return
        if self.ev.stop_requested is None:
            self.ev.stop_requested = name
            self._begin_stop(now, self.config.grace_s)

    def _begin_stop(self, now: float, grace_s: float) -> None:
        if self.stopping:
            return
        self.stopping = True
        sig = self.config.stop_signal
        if signal_group(self.child, sig):
            self.signal_sent = signal.Signals(sig).name
        self.kill_at = now + grace_s

    def _timers(self, now: float) -> None:
        if self.kill_at is not None and now >= self.kill_at and self.child.returncode is None:
            self.killed_after_grace = not self.hard_stop
            signal_group(self.child, signal.SIGKILL)
            self.kill_at = None
        if not self.stopping:
            why = self.hang.check(now)
            if why is not None and self.child.returncode is None:
                self._on_hang(why)

    def _on_hang(self, why: str) -> None:
        log.warning("training process hung: %s; collecting stacks", why)
        self.ev.hang, self.ev.hang_detail, self.ev.hang_at = True, why, time.time()
        pids = [p.pid for p in self.tree.live()]
        self.stack_files = dump_stacks(
            pids, self.child.spec.attempt_dir, self.config.dump_signal, self.config.dump_timeout_s
        )
        self._begin_stop(self.clock(), self.config.hang_grace_s)

    def _sample(self, now: float) -> None:
        tree = self.tree.sample(now)
        if tree.cpu_progress:
            self.hang.activity(now)
        reading = self.gpu.read(tree.pids) if self.gpu.available else GpuReading()
        for dev in reading.devices:
            if self.ev.gpu_mem_used_peak is None or dev.used > self.ev.gpu_mem_used_peak:
                self.ev.gpu_mem_used_peak, self.ev.gpu_mem_total = dev.used, dev.total
        if reading.lost and not self.ev.gpu_lost:
            log.warning("GPU lost: %s", reading.detail)
            self.ev.gpu_lost, self.ev.gpu_detail = True, reading.detail
            self._begin_stop(now, self.config.hang_grace_s)
        if self.on_sample is not None:
            self.on_sample(Sample(tree, reading))

    def _finish(self) -> Outcome:
        c, now = self.child, self.clock()
        for pipe in (c.stdout, c.stderr):
            pipe.pump(now)
        if self.hbs is not None:
            self._heartbeats(now)  # the last ones (e.g. "stop") arrive just before the exit
        swept, leftovers = sweep(c, self.tree, confirm_s=self.config.sweep_confirm_s)
        self._drain_pipes()
        rc = c.returncode
        ev = self.ev
        if rc is not None and rc < 0:
            ev.signal = signal.Signals(-rc).name
        else:
            ev.returncode = rc
        ev.stderr_tail = c.stderr.tail_text()
        ev.exit_records = read_exit_records(c.spec.attempt_dir)
        ev.peak_rss_bytes = self.tree.peak_rss
        ev.host_mem_available_min = self.tree.min_available
        ev.host_mem_total = _host_total()
        if self.cgroup is not None and self.oom_base is not None:
            ev.cgroup_oom_kills = max(0, (self.cgroup.oom_kills() or self.oom_base) - self.oom_base)
        ev.killed_after_grace = self.killed_after_grace
        ev.duration_s = now - self.t0
        hs = self.summary
        ev.stop_confirmed = hs.last_event == "stop"
        if hs.count == 0 or hs.last_step is None:
            # No step heartbeats: a plain script, or one that died before its first step.
            ev.first_step_seen = hs.count == 0 and plain_script_started(ev)
        failed = self._health_gate() if rc != 0 and not ev.stop_requested else ()
        stop = StopResult(
            returncode=rc,
            signal_sent=self.signal_sent,
            killed_after_grace=self.killed_after_grace,
            swept=swept,
            leftovers=leftovers,
            duration_s=self.clock() - now,
        )
        return Outcome(
            evidence=ev,
            heartbeats=self.summary,
            stop=stop,
            signals=self.signals_seen,
            hard_stop=self.hard_stop,
            pids_seen=sorted(self.tree.seen),
            stack_files=self.stack_files,
            failed_devices=failed,
        )

    def _health_gate(self) -> tuple[DeviceHealth, ...]:
        """After a failed attempt, NVML's device checks (reachable, retired pages, row
        remapping, fatal XIDs, the driver's recovery action): a device that fails them makes the
        failure `lost_device`, with the readings as evidence."""
        if not self.gpu.available:
            return ()
        failed = tuple(h for h in self.gpu.health() if problems(h))
        if failed:
            self.ev.gpu_lost = True
            found = describe(list(failed))
            self.ev.gpu_detail = "; ".join(filter(None, [self.ev.gpu_detail, found]))
        return failed

    def _drain_pipes(self) -> None:
        # Everyone that could hold the write ends is dead now, so EOF comes at once.
        deadline = time.monotonic() + _DRAIN_S
        pipes = [p for p in (self.child.stdout, self.child.stderr) if not p.closed]
        with selectors.DefaultSelector() as sel:
            for pipe in pipes:
                sel.register(pipe.fd, selectors.EVENT_READ, pipe)
            while sel.get_map() and time.monotonic() < deadline:
                for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                    if not key.data.pump(self.clock()):
                        sel.unregister(key.fd)
        for pipe in pipes:
            pipe.close()


def read_exit_records(attempt_dir: Path) -> list[dict]:
    """Exit records the ranks wrote (contract 2), ordered by rank; unreadable ones are skipped."""
    records = []
    for path in attempt_dir.glob("exit-rank*.json"):
        try:
            record = ExitRecord.from_json(path.read_text())
        except OSError:
            continue
        if record is not None:
            if record.time is None:  # older workers: the file's own time orders it
                record.time = path.stat().st_mtime
            records.append(asdict(record))
    return sorted(records, key=lambda r: r["rank"])


def _host_total() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
