"""The launch's warm standby: kept while an attempt trains, used by the next one.

Carries out standby/decide.py with standby/warm_child.py and records what happened: `standby_ready`,
`standby_discarded` (ended unused), `standby_failed` (the attempt starts cold instead). At most
one standby exists; it belongs to the launch, not to an attempt, so the attempt's process tree
leaves it out (`pids`, in Loop._helper_pids) and no sweep ends it.

Standbys are forked from a zygote: an interpreter that imported the preload once (at the lowest
priority, the launch's first one only) and is kept across attempts. A forked standby imports
nothing, so one is forked at an attempt's first sample (a quarter of a second in) and is ready
within milliseconds of it. The zygote itself is started at the first attempt's first sample
too where a core's worth of CPU went unused since the attempt started (standby/idle.py,
`standby_idle_cores`), so a failure in the launch's first seconds finds it importing or ready;
on a busy host it waits for the attempt's first heartbeat, as its import would slow the
attempt's. The zygote ends with the launch, with its standby when that is ended
unused for any reason (stale files, a changed environment, memory), and under memory pressure;
the next standby then starts a new one. A zygote that fails (or refuses to fork: threads running,
CUDA touched) makes the launch fall back to standbys that import by themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from rtrain.supervisor.config import Config
from rtrain.supervisor.pressure.monitor import host_reading
from rtrain.supervisor.proc import ranks
from rtrain.supervisor.proc.cgroup import MemoryCgroup, memory_cgroup
from rtrain.supervisor.proc.proctree import TreeSample
from rtrain.supervisor.proc.spawn import Child, ChildSpec
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.standby import decide as policy
from rtrain.supervisor.standby import idle
from rtrain.supervisor.standby.warm_child import (
    StandbyFailed,
    Target,
    WarmChild,
    same_target,
    strip_attempt_vars,
    target_of,
    worth_keeping,
)

READY_WAIT_S = 120.0
"""At an attempt's start, how long to wait for a standby still importing: it started before
a cold child would, so waiting for it is never slower than starting over (unless it hangs)."""


class StandbySlot:
    """The standby of one launch (None target: this launch keeps none)."""

    def __init__(self, cfg: Config, command: list[str], cwd: Path, run_dir: Path,
                 events: EventLog, say: Callable[[str], None]) -> None:
        self.cfg, self.cwd, self.run_dir, self.events, self.say = cfg, cwd, run_dir, events, say
        target = target_of(command, cwd) if cfg.standby else None
        self.target: Target | None = (target if target is not None
                                      and worth_keeping(target, cfg.preload) else None)
        self.warm: WarmChild | None = None
        self.zygote: WarmChild | None = None  # what self.warm is forked from
        self.forking = True  # False once a zygote failed: each standby imports by itself
        self.failures = 0
        self.rss: int | None = None  # the last standby's, measured when it was ready
        self._env: dict[str, str] | None = None  # the running attempt's, RTRAIN_* removed
        self._attempt = 0
        self._attempt_t0 = 0.0
        self._attempt_wall_ns = 0
        self._heartbeat = False
        self._next_stale_check = 0.0
        self._pressure = False  # memory pressure rose in the running attempt
        self._cpu_at_start: idle.CpuTimes = {}  # the CPUs' idle time when the attempt started
        self._group: MemoryCgroup | None = memory_cgroup(os.getpid()) if self.target else None
        self.after_growth = False
        """The attempt before stopped its group to take in a node waiting to join (feature.py):
        the next host's round waits for it (proc/ranks.handoff)."""
        self.failed_at: float | None = None
        """When the attempt before failed (unix time; feature.py), if this slot hosted it: over a
        range of nodes the next round's last call counts from it (proc/ranks.handoff)."""
        self.hosted = False
        """The running attempt started in the standby (its ranks' way out is the host's)."""

    @property
    def enabled(self) -> bool:
        return self.target is not None

    def pids(self) -> list[int]:
        return [w.pid for w in (self.warm, self.zygote) if w is not None]

    # ------------------------------------------------------------ an attempt starts

    def start(self, spec: ChildSpec, attempt: int,
              interrupted: Callable[[], bool] = lambda: False) -> tuple[Child | None, float]:
        """The attempt's child started in the standby, with the seconds the hand-off took;
        (None, 0) when there is none or it cannot be used (recorded): start it cold.
        `interrupted()`: a stop signal arrived (a standby still importing is not waited for).
        The next standby is forked at this attempt's first sample (a quarter of a second in;
        SpawnFacts.zygote_ready), not here: the launch is recorded and watched first."""
        child, took = self._start(spec, attempt, interrupted)
        self.hosted = child is not None
        self._attempt_wall_ns = time.time_ns()  # it starts now (after a wait for imports, maybe)
        return child, took

    def _start(self, spec: ChildSpec, attempt: int,
               interrupted: Callable[[], bool]) -> tuple[Child | None, float]:
        self._attempt, self._attempt_t0, self._heartbeat = attempt, time.monotonic(), False
        self._pressure = False
        self._cpu_at_start = idle.read()  # a file read: nothing next to the start it measures
        plan = ranks.plan_of(list(spec.argv))  # one node's ranks, which it would host
        env = spec.env if plan is None else ranks.standby_env(spec.env, plan)
        self._env = strip_attempt_vars(env)
        warm, self.warm = self.warm, None
        if warm is None and self.target is not None:
            warm = self._fork_for_start(attempt - 1, interrupted)
        if warm is None or self.target is None:
            return None, 0.0
        was_ready = warm.ready is not None
        if warm.ready is None and warm.failed is None:
            warm.wait_ready(READY_WAIT_S, interrupted)
            if warm.ready is None and warm.failed is None:
                self._end(warm, "standby_discarded", "a stop signal came while it imported",
                          attempt - 1)
                return None, 0.0
        else:
            warm.poll()
        if warm.ready is not None and not was_ready:
            self._note_ready(warm, attempt - 1)
        ready = warm.ready or {}
        use = policy.at_launch(policy.UseFacts(
            ready=warm.ready is not None, failed=warm.failed, cuda=bool(ready.get("cuda")),
            env_changes=policy.import_time_env_changes(warm.env, env),
            stale=warm.stale_files(),
            same_target=same_target(self.target, spec.argv, Path(spec.cwd))))
        if not use.use:
            self._end(warm, use.event, use.reason, attempt - 1)
            return None, 0.0
        t0 = time.monotonic()
        try:
            child = warm.activate(spec, None if plan is None else ranks.handoff(
                plan, spec.env, spec.attempt_dir, self.cfg.grace_s,
                after_growth=self.after_growth, failed_at=self.failed_at))
        except StandbyFailed as e:
            self._end(warm, "standby_failed", str(e), attempt - 1)
            return None, 0.0
        return child, time.monotonic() - t0

    def _fork_for_start(self, attempt: int,
                        interrupted: Callable[[], bool]) -> WarmChild | None:
        """A standby forked now for the attempt that starts: there was none waiting (the
        attempt before failed early), but a zygote was (still importing: it is waited for, as
        a standby still importing is)."""
        zygote = self.zygote
        if zygote is None:
            return None
        if zygote.ready is None and zygote.failed is None:
            zygote.wait_ready(READY_WAIT_S, interrupted)
            if zygote.ready is None and zygote.failed is None:
                self._end_zygote("standby_discarded", "a stop signal came while it imported",
                                 attempt)
                return None
        if not self._zygote_ok(attempt):
            return None
        return self._fork(attempt)

    # ------------------------------------------------------------ while it trains

    def heartbeat(self) -> None:
        """The attempt trains: its first heartbeat starts the standby at once, not at the next
        sample (an attempt that fails a moment later still finds one on its way)."""
        first, self._heartbeat = not self._heartbeat, True
        if first and self.warm is None:
            self._tick_now()

    def _tick_now(self) -> None:
        vm = psutil.virtual_memory()
        self.tick(TreeSample(time.monotonic(), (), 0, 0.0, False, vm.available, vm.total))

    def tick(self, tree: TreeSample) -> None:
        """Once per sample of the running attempt: spawn, notice ready, recycle."""
        if self.target is None or self._env is None:
            return
        host = host_reading(self._group, tree, self.cfg.pressure.fraction)
        now = time.monotonic()
        tight = policy.host_tight(host.used, host.limit, host.fraction)
        if self.zygote is not None:
            if self.warm is None and not self._zygote_waits(now, tight):
                return
            for out in self.zygote.outputs:
                out.pump()  # what a standby forked from it printed before its hand-off
        warm = self.warm
        if warm is not None:
            was_ready = warm.ready is not None
            warm.poll()
            if warm.failed is not None or (warm.ready or {}).get("cuda"):
                why = warm.failed or "CUDA was initialised while preloading"
                self._end(warm, "standby_failed", why, self._attempt)
                return
            if warm.ready is not None and not was_ready:
                self._note_ready(warm, self._attempt)
            why = self._why_not_keep(warm, now, tight)
            if why is not None:
                self._end(warm, "standby_discarded", why, self._attempt)
            return
        go, _ = policy.should_spawn(policy.SpawnFacts(
            enabled=True, failures=self.failures, running_s=now - self._attempt_t0,
            heartbeat_seen=self._heartbeat, host_used=host.used, host_limit=host.limit,
            fraction=host.fraction, standby_rss=self.rss, pressure=self._pressure,
            zygote_ready=self.zygote is not None and self.zygote.ready is not None,
            idle_core=self.zygote is None and not self._heartbeat and self._idle_core()))
        if go:
            self._spawn()

    def _idle_core(self) -> bool:
        """Whether a core's worth of CPU (`standby_idle_cores`) went unused since the attempt
        started: then what is spawned now imports beside it without slowing it."""
        need = self.cfg.standby_idle_cores
        return need <= 0 or idle.idle_cores(self._cpu_at_start, idle.read()) >= need

    def _why_not_keep(self, waiting: WarmChild, now: float, tight: bool) -> str | None:
        """Why a waiting standby or zygote must end now (its files are compared with what it
        imported every STALE_CHECK_S), None: it stays."""
        stale: list[str] = []
        if waiting.ready is not None and now >= self._next_stale_check:
            self._next_stale_check = now + policy.STALE_CHECK_S
            stale = waiting.stale_files()
        return policy.while_waiting(stale=stale, tight=tight)

    def _zygote_waits(self, now: float, tight: bool) -> bool:
        """The zygote, while no standby waits: read it, and end it when it failed, went stale
        or the host is tight (as a waiting standby would be). False: it ended."""
        zygote = self.zygote
        assert zygote is not None
        if zygote.ready is None:
            zygote.poll()
            if zygote.ready is not None:
                self.rss = zygote.rss()
        if not self._zygote_ok(self._attempt):
            return False
        why = self._why_not_keep(zygote, now, tight)
        if why is not None:
            self._end_zygote("standby_discarded", why, self._attempt)
            return False
        return True

    def _zygote_ok(self, attempt: int) -> bool:
        """False when the zygote failed (then it is ended, recorded, and no zygote is started
        again in this launch)."""
        zygote = self.zygote
        if zygote is None:
            return False
        zygote.poll()
        if zygote.failed is None and zygote.popen.poll() is not None:
            zygote.failed = f"the zygote exited with status {zygote.popen.returncode}"
        if zygote.failed is not None or (zygote.ready or {}).get("cuda"):
            self._end_zygote("standby_failed",
                             zygote.failed or "CUDA was initialised while preloading", attempt)
            return False
        return True

    def _fork(self, attempt: int) -> WarmChild | None:
        assert self.zygote is not None
        try:
            warm = self.zygote.fork()
        except StandbyFailed as e:
            self._end_zygote("standby_failed", str(e), attempt)
            return None
        self._next_stale_check = time.monotonic() + policy.STALE_CHECK_S
        return warm

    def make_room(self, why: str) -> None:
        """Host memory pressure in the running attempt: a waiting standby is dropped before
        anything is asked of the training (it is spawned by rtrain, so it sits in rtrain's
        memory cgroup, the run's: its memory counts against the limit the run is killed at),
        and none is spawned again in this attempt."""
        self._pressure = True
        warm = self.warm or self.zygote
        if warm is None:
            return
        rss = warm.rss()
        held = f" ({rss >> 20} MiB)" if rss else ""
        if warm is self.zygote:
            self._end_zygote("standby_discarded", f"memory pressure: {why}", self._attempt)
        else:
            self._end(warm, "standby_discarded", f"memory pressure: {why}", self._attempt)
        self.say(f"memory pressure: dropped the warm standby{held} first, as it counts against "
                 "the same memory; the next attempt starts cold")

    def _note_ready(self, warm: WarmChild, attempt: int) -> None:
        ready = warm.ready or {}
        self.rss = warm.rss()
        # When it became ready, from the start of the attempt it waits beside (its own clock:
        # the supervisor reads its message at the next sample).
        started_ns = self._attempt_wall_ns  # the attempt it waited beside
        ready_ns = int(ready.get("ready_ns") or ready.get("stamped_ns") or 0)
        since = max(0.0, (ready_ns - started_ns) / 1e9) if ready_ns and started_ns else None
        extra = {} if warm.zygote is None else {"zygote": warm.zygote.pid}
        self.events.emit("standby_ready", attempt=attempt, pid=warm.pid, rss_bytes=self.rss,
                         modules=ready.get("modules", []), import_s=ready.get("import_s"),
                         since_start_s=None if since is None else round(since, 3), **extra)

    def _spawn(self) -> None:
        assert self.target is not None and self._env is not None
        if self.zygote is not None:  # forked once it is ready (a fork needs no import)
            if self.zygote.ready is not None:
                self.warm = self._fork(self._attempt)
            return
        try:
            warm = WarmChild.spawn(self.target, self._env, self.cwd, self.run_dir,
                                   self.cfg.preload, zygote=self.forking)
        except OSError as e:
            self.failures += 1
            self.events.emit("standby_failed", attempt=self._attempt, pid=None,
                             reason=f"cannot start: {e.strerror or e}", output="")
            return
        if self.forking:
            self.zygote = warm
        else:
            self.warm = warm
        self._next_stale_check = time.monotonic() + policy.STALE_CHECK_S

    def _end(self, warm: WarmChild, kind: str, reason: str, attempt: int) -> None:
        """End a standby unused, and its zygote with it: what made the standby unusable
        (a changed file or variable, memory, a failure) holds for what it was forked from."""
        if self.warm is warm:
            self.warm = None
        warm.kill()
        if warm.zygote is not None and warm.zygote is self.zygote:
            self.zygote = None
            warm.zygote.kill()
        if kind == "standby_failed":
            self.failures += 1
            self.events.emit("standby_failed", attempt=attempt, pid=warm.pid, reason=reason,
                             output=warm.output_tail())
            self.say(f"warm standby failed ({reason}); starting cold"
                     + ("" if self.failures < policy.MAX_FAILURES
                        else "; no more standbys in this launch"))
        else:
            self.events.emit("standby_discarded", attempt=attempt, pid=warm.pid, reason=reason)

    def _end_zygote(self, kind: str, reason: str, attempt: int) -> None:
        """End the zygote while no standby forked from it waits (recorded as a standby's end:
        the next standby starts a new one, or, after a failure, imports by itself)."""
        zygote, self.zygote = self.zygote, None
        if zygote is None:
            return
        if kind == "standby_failed":
            self.forking = False
        self._end(zygote, kind, reason, attempt)

    def close(self) -> None:
        """End a waiting standby and its zygote: the launch is over (its end is on record
        already)."""
        for warm in (self.warm, self.zygote):
            if warm is not None:
                warm.kill()
        self.warm = self.zygote = None
