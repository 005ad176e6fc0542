"""What to do after an attempt ends: `decide`, a pure function of (failure, history, config).

It never sleeps, spawns or reads the clock: the jitter's random number comes in as `rand`, the
time as `now`, the newest verified checkpoint step as `newest_step`, the checkpoint the attempt
resumed from as `resumed`, and as `progressed` whether the attempt left a foreign checkpoint
whose content is new and verifies (`ckpt/progress.py`: a `ckpt.pt` rewritten in place).
Progress is a newer step or such content; it resets the crash-loop count, forgives budgets
and ends a quarantine streak alike. It returns a `Decision` holding a new `History` (the old one
is never mutated), which the loop persists in state.json.

Rules, in order: the table "What happens on each failure" in README.md, the one statement of
them: one row per rule, the first that applies decides. This function follows it row by row
(tests/test_policy_*.py hold it to it); whether a rung fits to climb back to is
pressure/decide.py's `climb_fits`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import ExitCode
from rtrain.supervisor.decide import budgets
from rtrain.supervisor.decide.failures import OUT_OF_MEMORY, Failure, FailureKind
from rtrain.supervisor.decide.history import History
from rtrain.supervisor.decide.ladder import Floor, step_down, step_up
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.decide.streak import (
    Resumed,
    killed_while_training,
    own_failure_step,
    quarantine_streak,
)
from rtrain.supervisor.pressure.decide import climb_fits, rung_peak

__all__ = ["Action", "Decision", "History", "ResumeMode", "Resumed", "decide", "note_progress",
           "quarantine_streak"]

class Action(str, enum.Enum):
    RELAUNCH = "relaunch"
    GIVE_UP = "give_up"
    EXIT_PREEMPTED = "exit_preempted"  # exit 75: the scheduler (or a wrapper) relaunches us
    REQUEUE = "requeue"  # requeue the Slurm job ourselves, then exit 75
    FINISHED = "finished"


class ResumeMode(str, enum.Enum):
    LATEST = "latest"  # the newest checkpoint that verifies
    ROLLBACK = "rollback"  # the verified checkpoint before the newest (it may hold NaN state)


@dataclass(frozen=True, kw_only=True)
class Decision:
    action: Action
    reason: str  # the sentence the user reads
    history: History  # updated; persist it before acting
    settings: dict[str, Any]  # knob values for the next attempt
    level: int  # ladder level for the next attempt
    resume: ResumeMode = ResumeMode.LATEST
    backoff_s: float = 0.0  # wait before relaunching
    exit_code: int | None = None  # rtrain's own exit status when it stops (0, 1, 3, 75)
    ladder_change: str | None = None  # what a rung step changed, for the degrade event
    alarm: str | None = None  # too many failures in the last hour: say it loudly
    quarantine: dict[str, Any] | None = None  # a checkpoint quarantined by this decision
    exclude_node: bool = False  # REQUEUE away from this node (a device failed on it)


def _budget_name(kind: FailureKind) -> str:
    return "oom" if kind in OUT_OF_MEMORY else kind.value


def backoff_s(config: Config, stalled: int, rand: float) -> float:
    """The wait before a relaunch after `stalled` attempts in a row without progress (this one
    included): none after a failure that followed progress, since a wait buys nothing there and
    costs every step of the run; then initial * factor**(stalled - 1), capped, minus up to
    `jitter` of itself at random."""
    b = config.backoff
    if not b.enabled or stalled < 1:
        return 0.0
    streak = stalled - 1
    # Cap the exponent first: factor**streak overflows long before any realistic streak ends.
    base = min(b.max_s, b.initial_s * b.factor ** min(streak, 64))
    return base * (1.0 - b.jitter * rand)


def _worker_settings(settings: dict[str, Any], ev: Observation | None) -> dict[str, Any]:
    """Adopt knobs the worker changed in-process (e.g. a batch its OOM back-off found)."""
    out = dict(settings)
    for rec in ev.exit_records if ev else []:
        for key, value in (rec.get("settings") or {}).items():
            if key in out:
                out[key] = value
    return out


def decide(failure: Failure | None, history: History, config: Config, *, rand: float,
           newest_step: int | None = None, now: float = 0.0,
           resumed: Resumed | None = None, committed: bool | None = None,
           on_slurm: bool = False, progressed: bool = False) -> Decision:
    """The next action. `failure` None means the child exited 0; `rand` is in [0, 1);
    `committed`: the attempt committed a checkpoint newer than `resumed` (None: judged from
    `newest_step`); `on_slurm`: we run in a Slurm job, which can be requeued elsewhere;
    `progressed`: new verified content in a foreign checkpoint (see the module docstring)."""
    settings = dict(config.settings if history.settings is None else history.settings)
    if failure is None:
        return Decision(action=Action.FINISHED, reason="training finished (exit 0)",
                        history=history, settings=settings, level=history.level,
                        exit_code=ExitCode.OK)
    ended = _stopped_or_startup(failure, history, config, settings)
    if ended is not None:
        return ended
    kind = failure.kind
    outside = kind is FailureKind.CRASH and killed_while_training(
        failure.seen, resumed.step if resumed else None, config.restart.trained_s)
    nxt = _count_attempt(history, newest_step, progressed, outside_kill=outside)
    advanced = _advanced(history, newest_step) or progressed
    if kind is FailureKind.PREEMPTED:  # exit 75 without a stop from us: relaunch, spend nothing
        return _relaunch(failure, history, nxt, config, settings, rand, backoff=False)
    if kind is FailureKind.BAD_CHECKPOINT:
        return _skip_checkpoint(failure, history, nxt, config, settings, rand)

    nxt, alarm = budgets.rate(budgets.forgive(nxt, config, newest_step, progressed), config,
                              now)
    spent = _out_of_budget(failure, history, nxt, config, settings, alarm)
    if spent is not None:
        return spent
    # An attempt that advanced the newest verified checkpoint (the crash-loop rule's
    # high-water mark) is not charged: the budgets count failures without progress, so a run
    # that keeps advancing between kills, however little each time, never runs out.
    if not advanced:
        nxt = budgets.charge(nxt, _budget_name(kind), newest_step)
    if committed is None:
        committed = newest_step is not None and (resumed is None or resumed.step is None
                                                 or newest_step > resumed.step)
    committed = committed or progressed
    nxt, quarantined = quarantine_streak(nxt, config, kind, resumed, committed,
                                         own_failure_step(failure.seen))
    if kind is FailureKind.LOST_DEVICE and on_slurm and config.requeue:
        return _requeue_elsewhere(failure, history, nxt, settings, alarm)
    if kind in OUT_OF_MEMORY:
        d = _degrade(failure, history, nxt, config,
                     _worker_settings(settings, failure.seen), rand)
    else:
        d = _relaunch(failure, history, nxt, config, settings, rand, backoff=True,
                      quarantined=quarantined)
    return replace(d, alarm=alarm, quarantine=quarantined if d.action is Action.RELAUNCH
                   else None)


def _stopped_or_startup(failure: Failure, history: History, config: Config,
                        settings: dict[str, Any]) -> Decision | None:
    """A stop the supervisor was asked for, or a script that fails at start-up: the launch
    ends, nothing is charged. None for every other failure."""
    ev = failure.seen
    if ev is not None and ev.stop_requested:
        action = Action.REQUEUE if config.requeue else Action.EXIT_PREEMPTED
        verb = "requeueing the job" if config.requeue else "exiting 75 so it can be requeued"
        return Decision(action=action, reason=f"{failure.reason}; {verb}",
                        history=replace(history, attempt=history.attempt + 1),
                        settings=settings, level=history.level, exit_code=ExitCode.PREEMPTED)
    if failure.kind is FailureKind.STARTUP:
        return Decision(action=Action.GIVE_UP, history=history, settings=settings,
                        level=history.level, exit_code=ExitCode.STARTUP,
                        reason=f"{failure.reason}; not retrying a script that fails at "
                               "start-up: fix the error and launch again")
    return None


def _advanced(history: History, newest_step: int | None) -> bool:
    """The newest verified step passed the highest any attempt reached."""
    high = history.launch_step
    return newest_step is not None and (high is None or newest_step > high)


def _count_attempt(history: History, newest_step: int | None,
                   progressed: bool = False, outside_kill: bool = False) -> History:
    """One more attempt; the newest step any launch reached, or one more stalled attempt (an
    attempt that left new foreign content progressed, whatever the step says). An attempt
    killed from outside while it trained (`outside_kill`) leaves the stalled streak as it was:
    it neither advanced nor failed by itself."""
    high = history.launch_step
    advanced = _advanced(history, newest_step)
    if advanced or progressed:
        stalled: tuple[int | None, ...] = ()
    elif outside_kill:
        stalled = history.stalled
    else:
        stalled = (*history.stalled, newest_step)
    return replace(history, attempt=history.attempt + 1,
                   launch_step=newest_step if advanced else high, stalled=stalled)


def _skip_checkpoint(failure: Failure, history: History, nxt: History, config: Config,
                     settings: dict[str, Any], rand: float) -> Decision:
    """bad_checkpoint: relaunch from the next older checkpoint, within max_restarts."""
    # Each such attempt uses up one checkpoint (it is not offered again), so this ends. It
    # counts toward max_restarts but not toward the crash-loop streak: it never trained, and
    # several bad checkpoints in a row must not hide the good one before them.
    if history.total_restarts >= config.restart.max_restarts:
        return _give_up(f"{failure.reason}; {history.total_restarts} relaunches spent, the "
                        f"limit: {config.restart.knob('max_restarts')}", history, settings)
    nxt = replace(nxt, total_restarts=history.total_restarts + 1, stalled=history.stalled)
    return _relaunch(failure, history, nxt, config, settings, rand, backoff=False)


def _out_of_budget(failure: Failure, history: History, nxt: History, config: Config,
                   settings: dict[str, Any], alarm: str | None) -> Decision | None:
    """GIVE_UP when the failure rate alarms under give_up_on_rate, or when max_restarts or the
    kind's budget is spent; None while the failure may still be charged."""
    if alarm and config.restart.give_up_on_rate:
        return _give_up(f"{failure.reason}; {alarm} (and [restart] give_up_on_rate is set)",
                        history, settings)
    spent = budgets.exhausted(nxt, config, _budget_name(failure.kind))
    if spent:
        return _give_up(f"{failure.reason}; {spent}", history, settings)
    return None


def _requeue_elsewhere(failure: Failure, history: History, nxt: History,
                       settings: dict[str, Any], alarm: str | None) -> Decision:
    # A broken device stays broken: relaunching here would fail again. Requeue the job
    # with this node excluded, so Slurm starts it on another one.
    return Decision(action=Action.REQUEUE, history=nxt, settings=settings,
                    level=history.level, exit_code=ExitCode.PREEMPTED, exclude_node=True,
                    alarm=alarm, reason=f"{failure.reason}; requeueing the job with this "
                                        "node excluded")


def _give_up(reason: str, history: History, settings: dict[str, Any]) -> Decision:
    return Decision(action=Action.GIVE_UP, reason=reason, history=history, settings=settings,
                    level=history.level, exit_code=ExitCode.GAVE_UP)


def _degrade(failure: Failure, before: History, nxt: History, config: Config,
             settings: dict[str, Any], rand: float) -> Decision:
    step = step_down(settings, config.ladder, nxt.level)
    if isinstance(step, Floor):
        tried = "; ".join(u["description"] for u in nxt.undo) or "nothing (no rung applied)"
        return _give_up(f"{failure.reason}; out of memory at the ladder's floor. Tried: {tried}. "
                        f"{step.message}", before, settings)
    # New settings are a new experiment: the crash-loop streak and healthy count start over.
    # The wait is the first one of a streak, and none where the attempt progressed.
    wait = backoff_s(config, min(len(nxt.stalled), 1), rand)
    nxt = replace(nxt, level=step.level, settings=step.settings, undo=(*nxt.undo, step.undo),
                  stalled=(), healthy_steps=0)
    return Decision(action=Action.RELAUNCH, history=nxt, settings=step.settings,
                    level=step.level, backoff_s=wait,
                    ladder_change=step.description,
                    reason=f"{failure.reason}; relaunching one rung down: {step.description}")


def _relaunch(failure: Failure, before: History, nxt: History, config: Config,
              settings: dict[str, Any], rand: float, *, backoff: bool,
              quarantined: dict[str, Any] | None = None) -> Decision:
    k, stalled = config.restart.crash_loop_k, nxt.stalled
    # A quarantine's fallback gets its attempt before the crash-loop rule may give up.
    if k and len(stalled) >= k and quarantined is None:
        at = f"step {stalled[-1]}" if stalled[-1] is not None else "none (no checkpoint yet)"
        return _give_up(f"{failure.reason}; crash loop: {len(stalled)} consecutive attempts "
                        f"ended without a newer verified checkpoint (newest: {at})",
                        before, settings)
    resume, change, notes = ResumeMode.LATEST, None, []
    if quarantined is not None:
        notes.append(f"quarantined {quarantined['path']} ({quarantined['reason']}), resuming "
                     "from the checkpoint before it")
    if failure.kind is FailureKind.NONFINITE:
        resume = ResumeMode.ROLLBACK
        settings, cut = _cut_lr(settings, config.lr_factor_on_nonfinite)
        nxt = replace(nxt, lr_factor=nxt.lr_factor * config.lr_factor_on_nonfinite)
        notes.append(f"rolling back one checkpoint, {cut}")
    level = nxt.level
    if (config.restore_after_steps and nxt.undo
            and nxt.healthy_steps >= config.restore_after_steps):
        fits, why = _rung_above_fits(nxt, config, failure.seen)
        if fits:
            settings = step_up(settings, nxt.undo[-1])
            change = f"undo {nxt.undo[-1]['description']}"
            level -= 1
            nxt = replace(nxt, undo=nxt.undo[:-1], level=level, healthy_steps=0)
            notes.append(f"climbing back one rung after {config.restore_after_steps} healthy "
                         f"steps ({change}; {why})")
        else:
            nxt = replace(nxt, healthy_steps=0)  # asked again after as many healthy steps
            notes.append(f"staying on this rung after {config.restore_after_steps} healthy "
                         f"steps: the rung above does not fit ({why})")
    nxt = replace(nxt, settings=settings)
    wait = backoff_s(config, len(stalled), rand) if backoff else 0.0
    if failure.kind is FailureKind.BAD_CHECKPOINT:
        notes.append("skipping that checkpoint")
    what = "; ".join(["relaunching", *notes]) if notes else "relaunching on the same settings"
    return Decision(action=Action.RELAUNCH, reason=f"{failure.reason}; {what}", history=nxt,
                    settings=settings, level=level, resume=resume, backoff_s=wait,
                    ladder_change=change)


def _rung_above_fits(history: History, config: Config,
                     ev: Observation | None) -> tuple[bool, str]:
    p = config.pressure
    return climb_fits(history.rung_peaks.get(str(history.level - 1)),
                      host_limit=ev.memory_limit if ev else None,
                      gpu_limit=ev.gpu_mem_total if ev else None,
                      fraction=p.fraction, gpu_fraction=p.gpu_fraction,
                      headroom=p.climb_headroom)


def _cut_lr(settings: dict[str, Any], factor: float) -> tuple[dict[str, Any], str]:
    out = dict(settings)
    lr = out.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        out["lr"] = lr * factor
        return out, f"lr {lr:g} -> {out['lr']:g}"
    # No lr knob: record the factor for a worker that scales its own learning rate.
    out["lr_scale"] = out.get("lr_scale", 1.0) * factor
    return out, f"lr_scale -> {out['lr_scale']:g}"


def note_progress(history: History, seen: Observation, *, resumed_step: int | None,
                  duration_s: float = 0.0) -> History:
    """Count the steps an attempt made (from `resumed_step`, or 0 on a fresh start) as healthy,
    and, with its duration, as progress since the last charged failure; record its memory
    peak as its rung's."""
    history = _record_peak(history, seen)
    if seen.last_step is None:
        return history
    made = max(seen.last_step - (resumed_step or 0), 0)
    history = budgets.count_progress(history, made, duration_s)
    return replace(history, healthy_steps=history.healthy_steps + made)


def _record_peak(history: History, ev: Observation) -> History:
    key = str(history.level)
    peak = rung_peak(history.rung_peaks.get(key), host=ev.peak_rss_bytes,
                     host_limit=ev.memory_limit,
                     gpu=ev.gpu_mem_used_peak, gpu_limit=ev.gpu_mem_total)
    if peak is None or peak == history.rung_peaks.get(key):
        return history
    return replace(history, rung_peaks={**history.rung_peaks, key: peak})
