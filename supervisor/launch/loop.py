"""`rtrain launch`: the supervision loop.

    pick checkpoint -> spawn child -> watch -> classify -> decide -> record -> (relaunch | stop)

Each stage lives in its own module; this one wires them together, owns the run directory (lock,
events.jsonl, state.json, attempts/) and turns a decision into an action. The clock, the GPU
reader, the random source and the sleeper are injected so tests can script them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor import filemode, protocol
from supervisor.ckpt import foreign, generation, quarantine
from supervisor.ckpt.hashing import load_signing_key
from supervisor.ckpt.verify import Level, Selection, Verdict, first_good, mark_quarantined
from supervisor.commands.statusline import StatusLine
from supervisor.config import Config
from supervisor.decide import templates
from supervisor.decide.classify import classify, plain_script_started
from supervisor.decide.failures import FailureKind
from supervisor.decide.policy import (
    Action,
    Decision,
    History,
    Resumed,
    ResumeMode,
    decide,
    note_progress,
)
from supervisor.errors import ExitCode, UsageError
from supervisor.fsio import STORAGE_ERRNOS
from supervisor.proc import slurm
from supervisor.proc.console import BestEffortWriter, best_effort_console
from supervisor.proc.gpu import GpuReader, NvmlReader, wait_gpu_released
from supervisor.proc.gpu_health import describe, problems
from supervisor.proc.heartbeat import HeartbeatReceiver
from supervisor.proc.leftovers import ProcRecord, end_leftovers
from supervisor.proc.proctree import ProcTree
from supervisor.proc.spawn import ChildSpec, spawn
from supervisor.proc.watch import Outcome, Sample, SignalCatcher, WatchConfig, watch
from supervisor.records import saves
from supervisor.records.events import EventLog, read_events
from supervisor.records.hooks import HookRunner
from supervisor.records.lock import RunLock
from supervisor.records.metrics import MetricsFile
from supervisor.records.runstate import RunState, RunStatus, load_state, save_state
from supervisor.safetext import safe

log = logging.getLogger(__name__)

# A run that ends while the run dir's disk is full waits this long for room to record how it
# ended (state.json, the last events); supervision itself never waits for the disk.
RECORD_WAIT_S = 60.0



@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What `rtrain launch` was asked to run."""

    command: list[str]
    """The child's argv, knob templates (`{batch_size}`) not yet filled in."""
    config: Config
    fresh: bool = False
    """Start the run over even when state.json says it finished."""
    retry: bool = False
    """Relaunch a run that gave up: fresh budgets, quarantines lifted (a person decided)."""
    echo: bool = True
    """Tee the child's output to our terminal (always also to attempts/<n>/)."""
    cwd: Path = field(default_factory=Path.cwd)
    resume_args: tuple[str, ...] = ()
    """Appended to the child's argv, templates filled in, only when resuming from a checkpoint
    (`--resume-arg "--resume_from_checkpoint {checkpoint}"`, shell-split)."""


@dataclass(kw_only=True)
class Seams:
    """Everything outside the process that tests replace."""

    gpu: GpuReader | None = None  # default: NVML (says once when there is none)
    rand: Callable[[], float] = random.random
    wall: Callable[[], float] = time.time
    say: Callable[[str], None] = lambda line: print(f"rtrain: {line}", file=sys.stderr,
                                                    flush=True)


def child_command(script: str | None, module: str | None, args: list[str],
                  python: str | None = None) -> list[str]:
    """The argv to run: `python SCRIPT ARGS`, `python -m MODULE ARGS`, or an executable as is
    (e.g. `torchrun ...`)."""
    py = python or sys.executable
    if module:
        return [py, "-m", module, *args]
    if script is None:
        raise UsageError("nothing to launch: give a script (train.py), -m module, or a command "
                         "after --")
    if script.endswith(".py"):
        if not Path(script).is_file():
            raise UsageError(f"no such script {script!r} (relative to {Path.cwd()})")
        return [py, script, *args]
    exe = shutil.which(script)
    if exe is None:
        raise UsageError(f"{script!r} is neither a .py script nor a command on PATH")
    return [script, *args]


def launch(spec: LaunchSpec, seams: Seams | None = None) -> int:
    """Supervise the run until it finishes, gives up or is stopped; returns rtrain's exit code."""
    seams = seams or Seams()
    cfg = spec.config
    run_dir = Path(cfg.run_dir)
    _prepare_dirs(run_dir, Path(cfg.ckpt_dir or run_dir / "checkpoints"), cfg.file_mode)
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).exists():
        raise UsageError(f"--resume {cfg.resume}: no such checkpoint")
    blank = {**cfg.settings, "checkpoint": "", "attempt": 0, "run_dir": "", "ckpt_dir": ""}
    templates.render([*spec.command, *spec.resume_args], blank)  # typos fail before any work
    with RunLock(run_dir, mode=cfg.file_mode) as lock, best_effort_console() as console:
        loop = _Loop(spec, seams, run_dir)
        loop.console = console
        loop.end_leftovers()
        if lock.previous is not None:
            loop.events.emit("lock_takeover", previous=lock.previous)
        try:
            return loop.run()
        finally:
            loop.close()


class _Loop:
    def __init__(self, spec: LaunchSpec, seams: Seams, run_dir: Path) -> None:
        self.spec, self.seams, self.cfg, self.run_dir = spec, seams, spec.config, run_dir
        self.ckpt_dir = Path(self.cfg.ckpt_dir or run_dir / "checkpoints")
        self.key = load_signing_key()
        # Observers of the event log (config: metrics_file, [[hooks]]); fed by EventLog
        # listeners and polled from the watch callbacks, never in the loop's way.
        self.metrics = (MetricsFile(self.cfg.metrics_file, run_dir=run_dir,
                                    ckpt_dir=self.ckpt_dir, wall=seams.wall)
                        if self.cfg.metrics_file else None)
        if self.metrics is not None:
            for event in read_events(run_dir / "events.jsonl"):  # counters continue the run's
                self.metrics.seed(event)
        self.hooks = (HookRunner(self.cfg.hooks, cwd=spec.cwd,
                                 env={protocol.ENV_RUN_DIR: str(run_dir.resolve())})
                      if self.cfg.hooks else None)
        self.events = EventLog(run_dir / "events.jsonl", clock=seams.wall,
                               listeners=[o for o in (self.metrics, self.hooks) if o],
                               mode=self.cfg.file_mode)
        if self.hooks is not None:
            self.hooks.report = self.events.emit
        self.gpu = seams.gpu if seams.gpu is not None else NvmlReader()
        self.hb = HeartbeatReceiver()
        self.watch_cfg = WatchConfig.from_config(self.cfg)
        self.line = StatusLine(sys.stderr) if spec.echo else None
        self.state = self._load_state()
        self._last_summary = 0.0
        self.console: list[BestEffortWriter] = []  # our stdout/stderr, when they are real
        self._state_unsaved = False  # state.json could not be written (disk full): retried
        self.procs = ProcRecord(run_dir)  # the attempt's processes, for the next launch
        self._skipped: list[dict[str, Any]] = []  # save_skipped events of this launch
        self._last_step: int | None = None  # of the attempt that just ended

    def say(self, text: str) -> None:
        if self.line is None:
            self.seams.say(text)
            return
        with self.line.suspend():
            self.seams.say(text)

    def close(self) -> None:
        self._record_final()
        if self.line is not None:
            self.line.clear()
        self.hb.close()
        self.gpu.close()
        if self.hooks is not None:
            self.hooks.close()  # a give-up alert runs to its deadline
        if self.metrics is not None:
            self.metrics.stopped()
        self.events.close()

    def end_leftovers(self) -> None:
        """End what an earlier rtrain of this run dir left running (it was SIGKILLed)."""
        ended = end_leftovers(self.run_dir)
        if ended:
            self.events.emit("leftovers_ended", pids=[p.pid for p in ended],
                             commands=[p.command for p in ended], found=[p.why for p in ended])
            self.say(f"ended {len(ended)} processes an earlier rtrain of this run left running: "
                     + ", ".join(f"pid {p.pid} ({p.command[:60]})" for p in ended))

    # ------------------------------------------------------------ run state

    def _load_state(self) -> RunState:
        now = self.seams.wall()
        old = load_state(self.run_dir)
        # --resume never / PATH apply to the first launch of a new run (or a --retry) only; a
        # run continued (requeued, relaunched by cron) resumes from its newest checkpoint.
        self._new_run = old is None or self.spec.fresh or self.spec.retry
        attempts = self.run_dir / "attempts"
        if self.spec.fresh and attempts.exists():
            # A fresh run numbers its attempts from 0 again; the old run's logs are kept aside.
            _move_aside(attempts, now)
        if old is None or self.spec.fresh:
            return RunState(command=self.spec.command, cwd=str(self.spec.cwd), created=now,
                            updated=now)
        if old.command != self.spec.command:
            self.say(f"note: {self.run_dir} was started with a different command "
                     f"({' '.join(old.command)}); continuing the run with this one")
        history = old.history
        if self.spec.retry:
            # A person decided to try again: new budgets and no quarantine, same rung and
            # attempt numbering.
            history = replace(history, budgets_used={}, total_restarts=0, stalled=(),
                              failure_times=(), streak=None, quarantined=())
        return replace(old, command=self.spec.command, history=history)

    def _save(self, status: RunStatus, reason: str, history: History) -> None:
        self.state = replace(self.state, status=status, reason=reason, history=history,
                             updated=self.seams.wall())
        self._write_state()

    def _write_state(self) -> bool:
        """Write state.json; on a full or failing disk keep it for a later try (the samples'
        ticks and the end of the run) instead of stopping the supervision."""
        try:
            save_state(self.run_dir, self.state, mode=self.cfg.file_mode)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            if not self._state_unsaved:
                self.say(f"cannot write state.json in {self.run_dir} ({e.strerror}): kept "
                         "until there is room; training goes on")
            self._state_unsaved = True
            return False
        self._state_unsaved = False
        return True

    def _record_final(self) -> None:
        """Wait (bounded) for room to write the events and state.json that are still held."""
        deadline, told = time.monotonic() + RECORD_WAIT_S, False
        while not self.events.retry() or (self._state_unsaved and not self._write_state()):
            if time.monotonic() >= deadline:
                self.say(f"no room in {self.run_dir} after {RECORD_WAIT_S:g} s: "
                         f"{self.events.pending} events"
                         + (" and state.json" if self._state_unsaved else "") + " not recorded")
                return
            if not told:
                self.say(f"waiting up to {RECORD_WAIT_S:g} s for room in {self.run_dir} to "
                         "record how the run ended")
                told = True
            time.sleep(0.5)

    # ------------------------------------------------------------ the loop

    def run(self) -> int:
        if self.state.status is RunStatus.FINISHED:
            self.say(f"the run in {self.run_dir} already finished "
                     f"({self.state.reason}); nothing to do (pass --fresh to run it again)")
            return 0
        if self.state.status is RunStatus.GAVE_UP and not self.spec.retry:
            # A wrapper (cron, a Slurm batch script) repeating the command must not restart a
            # hopeless run forever: it gets its own exit code and can stop requeueing.
            self.say(f"the run in {self.run_dir} gave up: {self.state.reason}. Not relaunching "
                     f"(exit {int(ExitCode.GAVE_UP_EARLIER)}); fix the cause, then pass --retry "
                     "to relaunch it with fresh budgets, or --fresh to start over")
            return ExitCode.GAVE_UP_EARLIER
        history = self.state.history
        self._publish_quarantine(history)
        while (self.run_dir / "attempts" / str(history.attempt)).exists():
            # An rtrain that died (SIGKILL, lost node) launched this attempt and never decided
            # on it: this launch is a relaunch and gets the next number (contract 1), so the
            # attempt's logs stay where they are and faults armed for it do not fire again.
            history = replace(history, attempt=history.attempt + 1)
        resume = ResumeMode.LATEST
        with SignalCatcher() as signals:
            while True:
                selection = self._pick(history, resume)
                if selection is None:  # an explicit --resume PATH that does not verify
                    return 2
                chosen = selection.chosen
                # A foreign checkpoint whose name states no step has step -1: unknown.
                resumed_step = chosen.step if chosen and chosen.step >= 0 else None
                settings = dict(self.cfg.settings if history.settings is None
                                else history.settings)
                if history.launch_step is None:
                    history = replace(history, launch_step=resumed_step)
                if history is not self.state.history or self.state.status is not RunStatus.RUNNING:
                    self._save(RunStatus.RUNNING, "running", history)  # a relaunch saved already
                # Its identity before the attempt runs: what the quarantine would name.
                resumed = (Resumed(path=str(chosen.path), step=resumed_step,
                                   id=quarantine.checkpoint_id(chosen.path))
                           if chosen is not None else None)
                started = time.time()  # compared with checkpoint mtimes: the real clock
                outcome, dur = self._attempt(history.attempt, settings, selection, signals)
                decision = self._decide(outcome, history, resumed, dur,
                                        self._committed_since(started, resumed), chosen)
                history = decision.history
                code = self._act(decision, signals, outcome.pids_seen)
                if code is not None:
                    return code
                resume = decision.resume

    def _publish_quarantine(self, history: History) -> None:
        """state.json is the record; the checkpoint dir's copy is what readers of the dir see.
        A dir rtrain cannot write (read-only, full) costs that copy, never the run (nor can any
        checkpoint have been saved there to be quarantined)."""
        try:
            quarantine.publish(self.ckpt_dir, history.quarantined, mode=self.cfg.file_mode)
        except OSError as e:
            self.say(f"cannot write {quarantine.QUARANTINE_FILE} in {self.ckpt_dir} "
                     f"({e.strerror}): other readers of the dir will not see the quarantine")

    def _pick(self, history: History, resume: ResumeMode) -> Selection | None:
        level = Level(self.cfg.verify)
        first, self._new_run = self._new_run, False
        if first and self.cfg.resume == "never":
            return Selection(None, [])
        if first and self.cfg.resume != "auto":
            v = foreign.verify_path(self.cfg.resume, level, self.key)
            if not v.ok:
                raise UsageError(f"--resume {self.cfg.resume} does not verify ({v.describe()}): "
                                 "pick another checkpoint or use --resume auto")
            return Selection(v, [])
        # Any format: rtrain's own, a Trainer's checkpoint-N dirs, Lightning / torch.save files.
        sel = self._select(level, history, skip_newest=1 if resume is ResumeMode.ROLLBACK else 0)
        for v in sel.skipped:
            self.say(f"skipping {safe(v.path.name)}: {safe(v.describe())}")  # names from disk
            self.events.emit("skipped_checkpoint", path=str(v.path), reason=v.describe())
        if resume is ResumeMode.ROLLBACK and sel.chosen is None:
            sel = self._select(level, history)  # nothing older: newest
        return sel

    def _select(self, level: Level, history: History, skip_newest: int = 0) -> Selection:
        """Resume selection, passing over quarantined checkpoints and those a worker of this run
        could not load (reported when that happened, in a `skipped_checkpoint` event)."""
        bad = set(history.bad_checkpoints)
        listed = (foreign.verify_candidate(c, level, self.key)
                  for c in foreign.list_candidates(self.ckpt_dir))
        verdicts = mark_quarantined(self.ckpt_dir, listed)
        return first_good((v for v in verdicts if not (v.ok and _identity(v) in bad)),
                          skip_newest)

    def _skip_bad_checkpoint(self, history: History, chosen: Verdict, reason: str) -> History:
        """The worker could not load `chosen`: record why, and never offer it again."""
        self.say(f"skipping {chosen.path.name} from now on: {reason}")
        self.events.emit("skipped_checkpoint", path=str(chosen.path),
                         reason=f"cannot load: {reason}")
        return replace(history, bad_checkpoints=(*history.bad_checkpoints, _identity(chosen)))

    def _attempt(self, attempt: int, settings: dict[str, Any], selection: Selection,
                 signals: SignalCatcher) -> tuple[Outcome, float]:
        chosen = selection.chosen
        resume_from = str(chosen.path.resolve()) if chosen else None
        attempt_dir = self.run_dir / "attempts" / str(attempt)
        if attempt_dir.exists():  # state.json was lost or reset: keep the old logs aside
            _move_aside(attempt_dir, self.seams.wall())
        values = {**settings, "checkpoint": resume_from or "", "attempt": attempt,
                  "run_dir": str(self.run_dir.resolve()), "ckpt_dir": str(self.ckpt_dir)}
        argv = templates.render(self.spec.command, values)
        if chosen is not None:
            argv += templates.render(list(self.spec.resume_args), values)
        env = self._child_env(attempt, settings, attempt_dir, resume_from)
        try:  # from now on, writers of earlier attempts cannot commit
            token = generation.new_token()
            generation.advance(self.ckpt_dir, token)
            env[protocol.ENV_GENERATION] = token
        except OSError as e:
            env.pop(protocol.ENV_GENERATION, None)
            self.say(f"cannot write the checkpoint generation in {self.ckpt_dir} ({e.strerror});"
                     " writers left from earlier attempts are not fenced off")
        self.hb.drain()  # stale heartbeats of the previous attempt
        for out in self.console:
            out.hint = f"{attempt_dir}/"
        child = spawn(ChildSpec(argv=argv, env=env, cwd=self.spec.cwd, attempt_dir=attempt_dir,
                                echo=self.spec.echo,
                                log_cap_bytes=int(self.cfg.log_cap_mb * 2**20),
                                echo_through=self.line.write_through if self.line else None))
        self.procs.update([child.pid])
        if self.line is not None:
            self.line.update(attempt=attempt, level=self.state.history.level, step=None,
                             loss=None, samples_per_s=None)
        how = f"from {chosen.path.name}" if chosen else "fresh"
        self.say(f"attempt {attempt}: launched pid {child.pid} ({how}), settings "
                       f"{json.dumps(settings)}")
        self.events.emit("launch", attempt=attempt, argv=argv, settings=settings,
                         level=self.state.history.level, resume_from=resume_from, pid=child.pid,
                         ckpt_dir=str(self.ckpt_dir), **_slurm_field())
        t0 = time.monotonic()
        self._last_summary = float("-inf")  # each attempt's first step starts its curve
        tree = ProcTree(exclude=self.hooks.pids) if self.hooks is not None else None
        outcome = watch(child, self.watch_cfg, heartbeats=self.hb, gpu=self.gpu, signals=signals,
                        tree=tree, on_heartbeat=lambda hb: self._on_heartbeat(attempt, hb),
                        on_sample=self._on_sample)
        child.close()
        self.procs.update([])  # swept
        return outcome, time.monotonic() - t0

    def _child_env(self, attempt: int, settings: dict[str, Any], attempt_dir: Path,
                   resume_from: str | None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            protocol.ENV_RUN_DIR: str(self.run_dir.resolve()),
            protocol.ENV_CKPT_DIR: str(self.ckpt_dir.resolve()),
            protocol.ENV_ATTEMPT: str(attempt),
            protocol.ENV_SETTINGS: json.dumps(settings),
            protocol.ENV_STATUS: str(attempt_dir.resolve()),
            protocol.ENV_STOP_SIGNAL: self.cfg.stop_signal,
            protocol.ENV_HEARTBEAT: self.hb.name,
            protocol.ENV_DUMP_SIGNAL: signal.Signals(self.watch_cfg.dump_signal).name,
            filemode.ENV_FILE_MODE: f"{self.cfg.file_mode:04o}",
            "PYTHONUNBUFFERED": "1",  # output reaches the tee (and hang detection) at once
        })
        if resume_from:
            env[protocol.ENV_RESUME_FROM] = resume_from
        else:
            env.pop(protocol.ENV_RESUME_FROM, None)
        return env

    def _observe(self, hb: protocol.Heartbeat | None = None) -> None:
        """Watch ticks for the observers: metrics ages, hooks past their deadline."""
        if self.metrics is not None:
            if hb is not None:
                self.metrics.heartbeat(hb.step)
            else:
                self.metrics.tick()
        if self.hooks is not None:
            self.hooks.poll()

    def _on_sample(self, sample: Sample) -> None:
        self._observe()
        for out in self.console:  # echo held back while the console was slow
            out.try_flush()
        if self.events.retry() and self._state_unsaved:  # held while the disk was full
            self._write_state()
        self.procs.update(sample.tree.pids)
        if self.line is None:
            return
        used = sum(d.used for d in sample.gpu.devices) if sample.gpu.devices else None
        total = sum(d.total for d in sample.gpu.devices) if sample.gpu.devices else None
        self.line.update(rss_bytes=sample.tree.rss_bytes, gpu_used=used, gpu_total=total)

    def _on_heartbeat(self, attempt: int, hb: protocol.Heartbeat) -> None:
        self._observe(hb)
        if hb.event == "save_skipped":
            self._skipped.append(self.events.emit("save_skipped", attempt=attempt, step=hb.step,
                                                  rank=hb.rank, reason=hb.reason))
            self.say(f"checkpoint at step {hb.step} not saved: {hb.reason}")
        if self.line is not None and hb.step is not None:
            self.line.update(step=hb.step, loss=hb.loss, samples_per_s=hb.samples_per_s,
                             next_save_step=hb.next_save_step)
        now = time.monotonic()
        if hb.event == "step" and now - self._last_summary >= self.cfg.summary_every_s:
            self._last_summary = now
            self.events.emit("heartbeat_summary", attempt=attempt, step=hb.step, loss=hb.loss,
                             samples_per_s=hb.samples_per_s)

    # ------------------------------------------------------------ decide and act

    def _decide(self, outcome: Outcome, history: History, resumed: Resumed | None,
                duration_s: float, committed: bool, chosen: Verdict | None = None) -> Decision:
        ev = outcome.evidence
        hs = outcome.heartbeats
        attempt = history.attempt
        self._last_step = ev.last_step
        ev.stop_confirmed = hs.last_event == "stop"
        if hs.count == 0 or hs.last_step is None:
            # No step heartbeats: a plain script, or one that died before its first step.
            ev.first_step_seen = hs.count == 0 and plain_script_started(ev)
        for name in outcome.signals:
            self.events.emit("signal", name=name)
        self.events.emit("exit", attempt=attempt, returncode=ev.returncode, signal=ev.signal,
                         duration_s=round(duration_s, 3), last_step=ev.last_step,
                         peak_rss_bytes=ev.peak_rss_bytes, gpu_used_peak=ev.gpu_mem_used_peak,
                         gpu_total=ev.gpu_mem_total, leftovers=outcome.stop.leftovers)
        if hs.last_step is not None:
            self.events.emit("heartbeat_summary", attempt=attempt, step=hs.last_step,
                             loss=hs.last_loss, samples_per_s=hs.samples_per_s,
                             rss_bytes=ev.peak_rss_bytes, gpu_used=ev.gpu_mem_used_peak,
                             gpu_total=ev.gpu_mem_total)
        failure = None
        if not (ev.returncode == 0 and not ev.signal):
            if not ev.stop_requested:
                self._check_devices(attempt, ev)
            failure = classify(ev, memory_pressure_fraction=self.cfg.memory_pressure_fraction)
            self.events.emit("classification", attempt=attempt, failure=failure.kind.value,
                             reason=failure.reason)
            self.say(f"attempt {attempt} failed: {failure.kind.value}: {failure.reason}")
            if failure.kind is FailureKind.BAD_CHECKPOINT and chosen is not None:
                history = self._skip_bad_checkpoint(history, chosen, failure.reason)
        history = note_progress(history, ev, resumed_step=resumed and resumed.step,
                                duration_s=duration_s)
        newest = self._newest_step()
        decision = decide(failure, history, self.cfg, rand=self.seams.rand(), newest_step=newest,
                          now=self.seams.wall(), resumed=resumed, committed=committed,
                          on_slurm=slurm.job_info() is not None)
        if decision.alarm:
            # Progress forgives failures, so a run can fail all day without stopping: say so.
            self.events.emit("failure_rate", attempt=attempt, detail=decision.alarm,
                             count=len(decision.history.failure_times),
                             limit=self.cfg.restart.max_failures_per_hour)
            self.say(f"WARNING: {decision.alarm}")
        if decision.quarantine:
            q = decision.quarantine
            self.events.emit("quarantine", attempt=attempt, path=q["path"], step=q["step"],
                             reason=q["reason"])
            self.say(f"quarantined {q['path']}: {q['reason']}")
        self.events.emit("decision", attempt=attempt, action=decision.action.value,
                         reason=decision.reason, backoff_s=round(decision.backoff_s, 3),
                         level=decision.level, settings=decision.settings,
                         exit_code=decision.exit_code, resume=decision.resume.value)
        if decision.ladder_change:
            self.events.emit("degrade", attempt=attempt, change=decision.ladder_change,
                             level=decision.level, settings=decision.settings)
            self.say(f"degrading: {decision.ladder_change} -> settings "
                     f"{json.dumps(decision.settings)}")
        return decision

    def _check_devices(self, attempt: int, ev: Any) -> None:
        """The health gate after a failed attempt: a device that fails its checks (NVML:
        reachable, retired pages, row remapping, fatal XIDs, the driver's recovery action) makes
        the failure `lost_device`, with the readings as evidence."""
        if not self.gpu.available:
            return
        readings = self.gpu.health()
        failed = [h for h in readings if problems(h)]
        if not failed:
            return
        self.events.emit("device_failed", attempt=attempt, detail=describe(failed),
                         devices=[h.to_dict() for h in failed], **_slurm_field())
        ev.gpu_lost = True
        ev.gpu_detail = "; ".join(filter(None, [ev.gpu_detail, describe(failed)]))

    def _committed_since(self, started: float, resumed: Resumed | None) -> bool:
        """Did the attempt commit a checkpoint newer than the one it resumed from? (A rollback
        resumes below the newest, so the newest step alone cannot tell.)"""
        floor = resumed.step if resumed is not None and resumed.step is not None else -1
        for c in foreign.list_candidates(self.ckpt_dir):
            if c.step is None or c.step <= floor:
                continue
            try:
                # A commit renames a dir whose manifest was written last: its mtime is the save's.
                if c.path.stat().st_mtime >= started:
                    return True
            except FileNotFoundError:
                continue
        return False

    def _newest_step(self) -> int | None:
        verdicts = (foreign.verify_candidate(c, Level.QUICK, self.key)
                    for c in foreign.list_candidates(self.ckpt_dir))
        for v in mark_quarantined(self.ckpt_dir, verdicts):
            if v.ok:
                return v.step if v.step >= 0 else None
        return None

    def _unsaved_final(self) -> str | None:
        """The run stops here: when failed saves left its last steps in no checkpoint, record
        it (`final_state_unsaved`) and return the warning; None when the state is saved."""
        newest = self._newest_step()
        warning = saves.unsaved_final(self._last_step, newest, self._skipped)
        if warning is not None:
            self.events.emit("final_state_unsaved", last_step=self._last_step,
                             checkpoint_step=newest, skipped_saves=len(self._skipped),
                             reason=warning)
        return warning

    def _act(self, decision: Decision, signals: SignalCatcher,
             pids: list[int]) -> int | None:
        history = decision.history
        if decision.action is Action.FINISHED:
            self._save(RunStatus.FINISHED, decision.reason, history)
            unsaved = self._unsaved_final()
            self.events.emit("finished", reason=decision.reason)
            self.say(f"finished: {decision.reason}")
            if unsaved:
                self.say(f"warning: {unsaved}")
            return decision.exit_code
        if decision.action is Action.GIVE_UP:
            self._save(RunStatus.GAVE_UP, decision.reason, history)
            self.events.emit("give_up", reason=decision.reason, exit_code=decision.exit_code)
            self.say(f"giving up: {decision.reason}")
            return int(decision.exit_code or 1)
        if decision.action in (Action.EXIT_PREEMPTED, Action.REQUEUE):
            reason = decision.reason
            if decision.action is Action.REQUEUE:
                if decision.exclude_node:
                    done, what = slurm.exclude_node()
                    self.events.emit("exclude_node", done=done, detail=what)
                    self.say(what)
                done, what = slurm.requeue()
                self.events.emit("requeue", done=done, detail=what)
                reason = f"{reason}; {what}"
            self._save(RunStatus.PREEMPTED, reason, history)
            unsaved = self._unsaved_final()
            self.say(f"stopped: {reason}")
            if unsaved:
                self.say(f"warning: {unsaved}")
            return decision.exit_code
        self._save(RunStatus.RUNNING, decision.reason, history)
        if decision.quarantine:  # before the next pick, which must pass over it
            self._publish_quarantine(history)
        self.events.sync()
        self.say(decision.reason)
        held = wait_gpu_released(self.gpu, pids, self.cfg.gpu_release_wait_s)
        if held:
            self.events.emit("gpu_not_released", pids=sorted(held))
            self.say(f"GPU memory still held by pids {sorted(held)} after "
                     f"{self.cfg.gpu_release_wait_s:g} s; relaunching anyway")
        if decision.backoff_s > 0 and _interrupted_wait(signals, decision.backoff_s):
            # A stop arrived during the backoff: no child runs, the newest checkpoint stands.
            names = [signal.Signals(s).name for s in signals.take()]
            self.events.emit("signal", name=",".join(names))
            self._save(RunStatus.PREEMPTED, f"stopped by {','.join(names)} during backoff",
                       history)
            return ExitCode.PREEMPTED
        return None


def _prepare_dirs(run_dir: Path, ckpt_dir: Path, file_mode: int) -> None:
    """Create the run and checkpoint dirs under the file-mode policy. One rtrain cannot write
    to (read-only, not ours) is a usage error before anything starts, not a traceback."""
    where = run_dir
    try:
        filemode.make_dir(run_dir, file_mode)
        fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".rtrain-probe-")
        os.close(fd)
        os.unlink(probe)
        where = ckpt_dir
        filemode.make_dir(ckpt_dir, file_mode)
    except OSError as e:
        flag = "--run-dir" if where == run_dir else "--ckpt-dir"
        raise UsageError(f"cannot write to {where} ({e.strerror}): give a writable {flag} "
                         "or fix its permissions") from None
def _identity(v: Verdict) -> str:
    """A checkpoint as a run remembers it: the path and when it was made (a checkpoint saved
    again at the same path is a different one)."""
    created = (v.manifest or {}).get("created")
    if created is None:
        try:
            created = os.stat(v.path).st_mtime_ns
        except OSError:
            created = None
    return f"{v.path.resolve()}|{created}"


def _slurm_field() -> dict[str, Any]:
    info = slurm.job_info()
    return {"slurm": info} if info else {}


def _move_aside(path: Path, now: float) -> None:
    """Rename `path` to `<name>.old-<time>[-n]`, never over an earlier one."""
    for n in range(1000):
        target = path.with_name(f"{path.name}.old-{int(now)}" + (f"-{n}" if n else ""))
        if not target.exists():
            path.rename(target)
            return
    raise UsageError(f"too many old copies of {path} beside it: remove some")


def _interrupted_wait(signals: SignalCatcher, seconds: float) -> bool:
    """Sleep up to `seconds`; True as soon as a stop signal arrives."""
    deadline = time.monotonic() + seconds
    fd = signals.fileno()
    while not signals.pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if fd is None:
            time.sleep(min(left, 0.1))
        else:
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                try:
                    os.read(fd, 512)
                except BlockingIOError:
                    pass
    return True
