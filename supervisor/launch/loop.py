"""`rtrain launch`: the supervision loop.

    pick checkpoint -> spawn child -> watch -> judge -> record -> act (relaunch | stop)

Read `Loop.run` and `Loop._run_attempt` top to bottom: that is the whole of it. After the spawn
the path runs one way: the watch (proc/watch.py) returns what it saw, frozen; the features add
what they found of the ending; the loop adds what only I/O can learn (the newest checkpoint,
whether the attempt committed one, the Slurm job, the time) into an `AttemptResult`; `judge`
(decide/attempt.py, pure) returns the decision and the records of the attempt's end; the loop
writes those records, then acts. Beside it in `launch/`: `spec` (what was asked, the seams),
`rundir` (state.json and the dirs), `resume` (which checkpoint), `child_env` (the attempt's argv
and environment), `observers` (the terminal, the heartbeats' events), `recording` (writing the
records), `side_effects` (Slurm requeue, GPU release, backoff), and `feature` (the protocol of
the optional features, supervisor/features.py, which this module never imports one by one).
The clock, the sleepers, the GPU reader, the random source, the spawner and the watcher come in
through `Seams`, so tests can script an attempt's outcome and fast-forward a backoff.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rtrain.checkpoint import generation
from rtrain.checkpoint.hashing import load_signing_key
from rtrain.checkpoint.verify import Verdict
from rtrain.supervisor import features as registry
from rtrain.supervisor.ckpt import foreign
from rtrain.supervisor.config import Config
from rtrain.supervisor.core import protocol
from rtrain.supervisor.core.errors import ExitCode, UsageError
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.attempt import AttemptResult, judge
from rtrain.supervisor.decide.policy import Action, Decision, History, ResumeMode
from rtrain.supervisor.launch import argv_templates, child_env, ckpt_owner, resize, side_effects
from rtrain.supervisor.launch.child_env import AttemptPlan
from rtrain.supervisor.launch.feature import Attempt, Features, Run
from rtrain.supervisor.launch.observers import Observers
from rtrain.supervisor.launch.recording import record, slurm_field
from rtrain.supervisor.launch.resume import Checkpoints, encryption_key, resumed_from
from rtrain.supervisor.launch.rundir import (
    RunRecord,
    move_aside,
    prepare_dirs,
    refuse_ended,
    refuse_planted,
)
from rtrain.supervisor.launch.spec import LaunchSpec, Seams, child_command
from rtrain.supervisor.pressure.monitor import PressureNote
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.proc.console import best_effort_console
from rtrain.supervisor.proc.gpu import NvmlReader
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.supervisor.proc.leftovers import ProcRecord, end_leftovers
from rtrain.supervisor.proc.proctree import ProcTree
from rtrain.supervisor.proc.signals import SignalCatcher
from rtrain.supervisor.proc.spawn import Child, ChildSpec
from rtrain.supervisor.proc.torchrun import several_nodes
from rtrain.supervisor.proc.watch import Sample, WatchConfig
from rtrain.supervisor.proc.watch_outcome import Outcome
from rtrain.supervisor.records import recovery
from rtrain.supervisor.records.events import EventLog, EventLogError
from rtrain.supervisor.records.lock import RunLock
from rtrain.supervisor.records.recovery import RecoveryTracker
from rtrain.supervisor.records.runstate import RunStatus
from rtrain.supervisor.records.timeline import Timeline, read_timeline
from rtrain.supervisor.timelimit.decide import WallPlan, measured
from rtrain.supervisor.timelimit.planner import WHY as WALL_CLOCK
from rtrain.supervisor.timelimit.planner import WallClock

__all__ = ["LaunchSpec", "Seams", "child_command", "launch"]


def launch(spec: LaunchSpec, seams: Seams | None = None) -> int:
    """Supervise the run until it finishes, gives up or is stopped; returns rtrain's exit code."""
    seams = seams or Seams()
    cfg = spec.config
    run_dir = Path(cfg.run_dir)
    prepare_dirs(run_dir, _ckpt_dir(cfg, run_dir), cfg.file_mode)
    names = registry.FEATURES if spec.features is None else spec.features
    refuse_planted(run_dir, _ckpt_dir(cfg, run_dir), registry.in_place(names))
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise UsageError(f"--resume {cfg.resume}: no such checkpoint")
    blank = {**cfg.settings, "checkpoint": "", "attempt": 0, "run_dir": "", "ckpt_dir": ""}
    argv_templates.render([*spec.command, *spec.resume_args], blank)  # typos fail before any work
    with RunLock(run_dir, mode=cfg.file_mode) as lock, best_effort_console() as console:
        loop = Loop(spec, seams, run_dir)
        loop.observers.console = console
        try:
            _end_leftovers(run_dir, loop.events, loop.say)
            if lock.previous is not None:
                loop.events.emit("lock_takeover", previous=lock.previous)
            return loop.run()
        finally:
            loop.close()


def _end_leftovers(run_dir: Path, events: EventLog, say: Callable[[str], None]) -> None:
    """End what an earlier rtrain of this run dir left running (it was SIGKILLed); say which
    processes procs.json names were left alone, and why."""
    swept = end_leftovers(run_dir)
    ended, skipped = swept.ended, swept.skipped
    if ended:
        events.emit("leftovers_ended", pids=[p.pid for p in ended],
                    commands=[p.command for p in ended], found=[p.why for p in ended])
        say(f"ended {len(ended)} processes an earlier rtrain of this run left running: "
            + ", ".join(f"pid {p.pid} ({p.command[:60]})" for p in ended))
    if skipped:
        events.emit("leftovers_skipped", pids=[p.pid for p in skipped],
                    commands=[p.command for p in skipped], reasons=[p.reason for p in skipped])
        for p in skipped:
            say(f"left pid {p.pid} ({p.command[:60]}) running, although procs.json names it: "
                f"{p.reason}")


def _read_timeline(path: Path) -> tuple[Timeline | None, str | None]:
    """The run's events so far, or None and why: a log that cannot be read (a line that is
    not an event, nested too deep, of a newer schema) is not a reason to stop a run. Events
    are best effort; this launch appends to the log and counts its own events from here."""
    try:
        return read_timeline(path), None
    except EventLogError as e:
        return None, str(e)


def _ckpt_dir(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.ckpt_dir or run_dir / "checkpoints")


class Loop:
    """One launch of a run: attempts until a decision stops it. Holds the run's parts (records,
    checkpoints, the terminal, the heartbeat socket, the GPU reader, the features) and the
    attempt in hand."""

    def __init__(self, spec: LaunchSpec, seams: Seams, run_dir: Path) -> None:
        self.spec, self.seams, self.cfg, self.run_dir = spec, seams, spec.config, run_dir
        self.ckpt_dir = _ckpt_dir(self.cfg, run_dir)
        # Each node of several fences its own writers only (checkpoint/generation.py).
        self.node_key = (generation.node_key(socket.gethostname(), run_dir)
                         if several_nodes(spec.command) else None)
        self.observers = Observers(echo=spec.echo, summary_every_s=self.cfg.summary_every_s,
                                   monotonic=seams.monotonic, say=seams.say)
        # The run so far, read once and kept current by each event this launch writes: a
        # relaunch must not re-read a log that grows by a summary every few seconds for weeks.
        self.timeline, unread = _read_timeline(run_dir / "events.jsonl")
        follow = [self.timeline.add] if self.timeline is not None else []
        self.recovery = RecoveryTracker()  # what each failure costs; emitted by _recoveries
        self.events = EventLog(run_dir / "events.jsonl", clock=seams.wall,
                               listeners=[*follow, self.recovery], mode=self.cfg.file_mode)
        self.observers.attach(self.events)
        self.say = self.observers.say
        if unread is not None:
            self.say(f"warning: {unread}; until then, the run's earlier events are not "
                     "counted (failures so far, save costs)")
        self.record = RunRecord(run_dir, self.cfg.file_mode, self.events, wall=seams.wall,
                                monotonic=seams.monotonic, sleep=seams.sleep, say=self.say)
        self.record.load(spec.command, spec.cwd, fresh=spec.fresh, retry=spec.retry)
        # A script's own checkpoint dir gets none of rtrain's files (ckpt_owner.py).
        self.script_owned = ckpt_owner.script_owns(self.ckpt_dir, command=spec.command,
                                                   resume_args=spec.resume_args, cwd=spec.cwd)
        self.checkpoints = Checkpoints(self.ckpt_dir, self.cfg, load_signing_key(), self.events,
                                       self.say, enc=encryption_key(), run_dir=run_dir,
                                       own_files=not self.script_owned)
        self.gpu = seams.gpu if seams.gpu is not None else NvmlReader()
        self.hb = HeartbeatReceiver()
        self.watch_cfg = WatchConfig.from_config(self.cfg)
        self.procs = ProcRecord(run_dir)  # the attempt's processes, for the next launch
        self.wall_clock = WallClock(self.cfg.slurm, run_dir / "events.jsonl")
        self._wall_said: str | None = None  # the plan last told the terminal
        self._last_step: int | None = None  # of the attempt that just ended
        run = Run(config=self.cfg, command=spec.command, resume_args=spec.resume_args,
                  cwd=spec.cwd, run_dir=run_dir, ckpt_dir=self.ckpt_dir, events=self.events,
                  say=self.say, checkpoints=self.checkpoints, seams=seams, gpu=self.gpu,
                  echo=spec.echo)
        names = registry.FEATURES if spec.features is None else spec.features
        self.features = Features(registry.make_all(run, names))
        self.events.listeners.append(self.features.event)

    def close(self) -> None:
        self.features.close()
        self.checkpoints.settle_copy()  # a copy in flight is the next launch's safety net
        self.record.record_final()
        self.hb.close()
        self.gpu.close()
        self.observers.close()
        self.events.close()

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        refused = refuse_ended(self.record.state, self.run_dir, retry=self.spec.retry,
                               say=self.say)
        if refused is not None:
            return refused
        history = self._first_history()
        resume, first = ResumeMode.LATEST, self.record.new_run
        starting_over = first and self.cfg.resume == "never"
        self.features.start(new_run=self.record.new_run, starting_over=starting_over)
        if starting_over:
            history = self.checkpoints.start_over(history, self.seams.wall(), self.spec.command)
        with SignalCatcher() as signals:
            while True:
                selection = self.checkpoints.pick(history, resume, first=first)
                named = first and self.cfg.resume != "auto"  # --resume PATH
                first = False
                if selection is None:  # an explicit --resume PATH that does not verify
                    return 2
                attempt = Attempt(number=history.attempt, chosen=selection.chosen,
                                  newest_allowed=resume is ResumeMode.LATEST and not named,
                                  attempt_dir=self.run_dir / "attempts" / str(history.attempt))
                decision, pids = self._run_attempt(history, attempt, signals)
                code = self._act(decision, signals, pids)
                if code is not None:
                    return code
                history, resume = decision.history, decision.resume

    def _first_history(self) -> History:
        history = self.record.state.history
        self.checkpoints.publish_quarantine(history)
        while (self.run_dir / "attempts" / str(history.attempt)).exists():
            # An rtrain that died (SIGKILL, lost node) launched this attempt and never decided
            # on it: this launch is a relaunch and gets the next number (contract 1), so the
            # attempt's logs stay where they are and faults armed for it do not fire again.
            history = replace(history, attempt=history.attempt + 1)
        return history

    def _run_attempt(self, history: History, attempt: Attempt,
                     signals: SignalCatcher) -> tuple[Decision, list[int]]:
        chosen = attempt.chosen
        resumed = resumed_from(chosen)
        settings = dict(self.cfg.settings if history.settings is None else history.settings)
        if history.launch_step is None:
            history = replace(history, launch_step=resumed.step if resumed else None)
        state = self.record.state
        if history is not state.history or state.status is not RunStatus.RUNNING:
            self.record.save(RunStatus.RUNNING, "running", history)  # a relaunch saved already
        started = time.time()  # compared with checkpoint mtimes: the real clock, not a seam
        before = self.checkpoints.snapshot()
        child, wall = self._spawn(attempt, settings, signals)
        outcome, duration_s = self._watch(child, attempt, wall, signals)
        # What the features found of the ending (the stuck ranks at a hang); the memory tier
        # commits its newest snapshot here, before anything reads the checkpoint dir.
        seen = replace(outcome.seen, **self.features.attempt_end(attempt, outcome.seen))
        if resumed is not None and not resumed.id:
            # Picked while the memory tier was still copying it (memtier/background_commit.py):
            # its identity on disk exists now (that copy has settled before this one began).
            resumed = resumed_from(chosen)
        result = AttemptResult(
            seen=seen, duration_s=duration_s, resumed=resumed,
            resumed_identity=foreign.resume_identity(chosen) if chosen is not None else None,
            committed=self.checkpoints.committed_since(started, resumed),
            progressed=self.checkpoints.progressed(before) is not None,
            newest_step=self.checkpoints.newest_step(), now=self.seams.wall(),
            rand=self.seams.rand(), slurm=slurm.job_info(), wall=wall)
        judgement = judge(result, history, self.cfg)
        record(judgement.records, self.events, self.say)
        self._last_step = seen.last_step
        self._recoveries()  # an attempt that ended before its first step ends its recovery
        return judgement.decision, outcome.pids_seen

    def _spawn(self, attempt: Attempt, settings: dict[str, Any],
               signals: SignalCatcher) -> tuple[Child, WallPlan | None]:
        """Start one attempt: a feature that takes the spawn (the warm standby), else a fresh
        process; the child, and the stop planned before the job's time limit."""
        self.features.attempt_start(attempt)
        chosen = attempt.chosen
        source = attempt.read_from or (chosen.path if chosen is not None else None)
        failures, run_s = self._failure_record()
        plan = AttemptPlan(attempt=attempt.number, settings=settings,
                           resume_from=str(source.resolve()) if source else None,
                           run_dir=self.run_dir, ckpt_dir=self.ckpt_dir,
                           attempt_dir=attempt.attempt_dir, failures=failures, run_s=run_s,
                           save_cost=self.timeline.save_cost if self.timeline else None,
                           run=self.checkpoints.run)
        if plan.attempt_dir.exists():  # state.json was lost or reset: keep the old logs aside
            move_aside(plan.attempt_dir, self.seams.wall())
        argv = child_env.argv(self.spec.command, self.spec.resume_args, plan)
        env = child_env.environment(plan, stop_signal=self.cfg.stop_signal,
                                    heartbeat_addr=self.hb.name,
                                    dump_signal=self.watch_cfg.dump_signal,
                                    relieve_signal=self.watch_cfg.relieve_signal,
                                    file_mode=self.cfg.file_mode)
        self.features.environment(attempt, env)
        if self.script_owned:
            env.pop(protocol.ENV_GENERATION, None)  # its writers commit no rtrain checkpoint
        else:
            child_env.fence_earlier_writers(env, self.ckpt_dir, self.say, self.node_key)
        attempt.env = env
        self.hb.drain()  # stale heartbeats of the previous attempt
        level = self.record.state.history.level
        wall = self.wall_clock.plan(self.seams.wall())  # the scheduler's times: before the spawn
        self.observers.attempt_started(attempt.number, plan.attempt_dir, level)
        line = self.observers.line
        child_spec = ChildSpec(
            argv=argv, env=env, cwd=self.spec.cwd, attempt_dir=plan.attempt_dir,
            echo=self.spec.echo, log_cap_bytes=int(self.cfg.log_cap_mb * 2**20),
            echo_through=line.write_through if line else None)
        spawn_at = self.seams.wall()  # a failure's cost: from here the new child is starting
        started = self.features.spawn(child_spec, attempt, lambda: bool(signals.pending))
        if started is None:
            t_spawn = self.seams.monotonic()
            child = self.seams.spawn(child_spec)
            start_s = self.seams.monotonic() - t_spawn
        else:
            child, start_s = started
        spawn_s = self.seams.wall() - spawn_at  # returns once the child exec'd or took over
        self.procs.update([child.pid])
        how = f"from {chosen.path.name}" if chosen else "fresh"
        if chosen is not None and self.checkpoints.restored:
            how += ", restored from rtrain's copy"
        how += "".join(attempt.notes)
        where = " in the warm standby" if started is not None else ""
        self.say(f"attempt {attempt.number}: launched pid {child.pid}{where} ({how}), "
                 f"settings {json.dumps(settings)}")
        tier = attempt.tier or ("disk" if chosen is not None else None)
        self.events.emit("launch", attempt=attempt.number, argv=argv, settings=settings,
                         level=level, resume_from=plan.resume_from, pid=child.pid,
                         ckpt_dir=str(self.ckpt_dir), standby=started is not None,
                         start_s=round(start_s, 4), spawn_at=round(spawn_at, 6),
                         spawn_s=round(spawn_s, 6), **slurm_field(wall),
                         **({"tier": tier} if tier else {}))
        self._say_wall(wall)
        return child, wall

    def _watch(self, child: Child, attempt: Attempt, wall: WallPlan | None,
               signals: SignalCatcher) -> tuple[Outcome, float]:
        """Watch the attempt to its end: what the watch saw, and how long it ran."""
        chosen = attempt.chosen
        sizes = resize.WorldWatch(resize.saved_world_size(chosen.manifest if chosen else None))
        n = attempt.number
        t0 = self.seams.monotonic()
        stop_at = None if wall is None or wall.stop_at is None else (
            t0 + wall.stop_at - self.seams.wall())  # the watch runs on the monotonic clock
        outcome = self.seams.watch(
            child, self.watch_cfg, heartbeats=self.hb, gpu=self.gpu, signals=signals,
            tree=ProcTree(exclude=self.features.pids),
            on_heartbeat=lambda hb: self._heartbeat(n, hb, sizes, chosen),
            on_sample=self._on_sample, stop_at=stop_at, stop_why=WALL_CLOCK,
            on_pressure=lambda note: self._pressure(n, note),
            on_hang=lambda: self.features.hang(attempt))
        child.close()
        self.observers.heartbeats_refused(n, self.hb.gate.take_refused())
        self.wall_clock.note(measured(outcome.seen))
        self.procs.update([])  # swept
        return outcome, self.seams.monotonic() - t0

    def _pressure(self, attempt: int, note: PressureNote) -> None:
        """Memory pressure: the features make room first (the warm standby, then the memory
        tier's snapshots), then what the watch asked of the child is recorded."""
        self.features.pressure(attempt, note)
        if note.action != "rising":
            self.observers.pressure(attempt, note)

    def _heartbeat(self, attempt: int, hb: Heartbeat, sizes: resize.WorldWatch,
                   chosen: Verdict | None) -> None:
        self.features.heartbeat(attempt, hb)
        self.observers.heartbeat(attempt, hb)
        self.recovery.heartbeat(attempt, hb)
        self._recoveries()
        size = sizes.heard(hb.world)
        if size is not None and chosen is not None:
            self.events.emit("world_size_changed", attempt=attempt, world_size=size,
                             saved_world_size=sizes.saved, checkpoint=chosen.path.name)
            self.say(f"attempt {attempt}: the group has {size} rank{'s' * (size != 1)}; "
                     f"{chosen.path.name} was written by {sizes.saved}")

    def _recoveries(self) -> None:
        """Record what the failures whose recovery just ended cost."""
        for r in self.recovery.take():
            self.events.emit("recovery", **r)
            self.say(f"cost of the {recovery.describe(r)}")

    def _failure_record(self) -> tuple[int | None, float | None]:
        """The run's work-losing failures and seconds run so far (earlier launches included);
        unknown when the log could not be read (the worker falls back to its prior)."""
        if self.timeline is None:
            return None, None
        return self.timeline.work_lost, self.timeline.run_s

    def _say_wall(self, wall: WallPlan | None) -> None:
        """Tell the terminal when the attempt will stop before the time limit (or why not),
        when that changed since the last attempt."""
        if wall is None:
            return
        if wall.stop_at is None:
            line = f"not stopping before the job's time limit: {wall.why}"
        else:
            at = time.strftime("%H:%M:%S", time.localtime(wall.stop_at))
            line = f"will save and stop at {at}, {wall.why}"
        if line != self._wall_said:
            self._wall_said = line
            self.say(line)

    def _on_sample(self, sample: Sample) -> None:
        self.checkpoints.watch_keep()
        self.features.sample(sample)
        self.observers.sample(sample)
        self.record.retry_held()  # held while the disk was full
        self.procs.update(sample.tree.pids)

    # ------------------------------------------------------------ act

    def _act(self, decision: Decision, signals: SignalCatcher, pids: list[int]) -> int | None:
        history, reason = decision.history, decision.reason
        if decision.action is not Action.RELAUNCH:
            # The run ends here: the standby's memory back, the newest checkpoint to the
            # mirror, a straggling node excluded before a requeue.
            self.features.run_end(decision)
        if decision.action is Action.FINISHED:
            self.record.save(RunStatus.FINISHED, reason, history)
            unsaved = self._unsaved_final()
            self.events.emit("finished", reason=reason)
            self.say(f"finished: {reason}")
            self._warn(unsaved)
            return decision.exit_code
        if decision.action is Action.GIVE_UP:
            self.record.save(RunStatus.GAVE_UP, reason, history)
            self.events.emit("give_up", reason=reason, exit_code=decision.exit_code)
            self.say(f"giving up: {reason}")
            return int(decision.exit_code or 1)
        if decision.action in (Action.EXIT_PREEMPTED, Action.REQUEUE):
            if decision.action is Action.REQUEUE:
                reason = side_effects.requeue(decision, self.events, self.say)
            self.record.save(RunStatus.PREEMPTED, reason, history)
            unsaved = self._unsaved_final()
            self.say(f"stopped: {reason}")
            self._warn(unsaved)
            return decision.exit_code
        self.record.save(RunStatus.RUNNING, reason, history)
        if decision.quarantine:  # before the next pick, which must pass over it
            self.checkpoints.publish_quarantine(history)
        self.events.sync()
        self.say(reason)
        stopped_by = side_effects.wait_before_relaunch(decision, signals, pids, gpu=self.gpu,
                                                       config=self.cfg, seams=self.seams,
                                                       events=self.events, say=self.say)
        if stopped_by is not None:
            # A stop arrived during the backoff: no child runs, the newest checkpoint stands.
            self.features.run_end(replace(decision, action=Action.EXIT_PREEMPTED))
            self.record.save(RunStatus.PREEMPTED,
                             f"stopped by {','.join(stopped_by)} during backoff", history)
            return ExitCode.PREEMPTED
        return None

    def _unsaved_final(self) -> str | None:
        return side_effects.unsaved_final(self.events, self._last_step,
                                          self.checkpoints.newest_step(),
                                          self.observers.skipped)

    def _warn(self, unsaved: str | None) -> None:
        if unsaved:
            self.say(f"warning: {unsaved}")
