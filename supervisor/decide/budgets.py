"""Restart budgets that refill with progress, and the failure-rate guard. Pure functions.

A relaunch after a failure that did not advance the newest verified checkpoint is *charged*:
one unit to its kind's budget (`crash`, `oom`, ...) and one to `max_restarts` (policy.py); a
failure after a newer checkpoint is not charged at all, so a run that advances between kills,
however little each time, never runs out. Charges are *forgiven*, all of them, once the run has
made real progress since the last one: a verified checkpoint newer than the newest at that
failure, and `forgive_after_steps` steps (or `forgive_after_s` seconds) of training. So a limit
counts the failures without progress in between: a week-long run whose node flakes every few
days never runs out, and one that fails without advancing still stops (the crash-loop rule
stops it first).
A script that reports no steps (it does not use the worker library: no heartbeats) shows its
training only by its checkpoints: new verified content in a foreign checkpoint since the last
charge (`progressed`, ckpt/progress.py) is both the newer checkpoint and the training.

The rate guard counts charged failures in the last hour, progress or not: above
`max_failures_per_hour` it raises an alarm (and gives up when `give_up_on_rate` is set).
"""

from __future__ import annotations

from dataclasses import replace

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.history import History

HOUR_S = 3600.0


def made_progress(history: History, config: Config, newest_step: int | None,
                  progressed: bool = False) -> bool:
    """Has the run made progress since its last charged failure (see the module docstring)?
    `progressed`: the attempt that just ended left new verified foreign content."""
    newer = progressed or (newest_step is not None and (history.charge_step is None
                                                        or newest_step > history.charge_step))
    r = config.restart
    trained = (history.progress_steps >= r.forgive_after_steps
               or (r.forgive_after_s > 0 and history.progress_s >= r.forgive_after_s)
               or (progressed and history.progress_steps == 0))  # no steps reported
    return newer and trained


def forgive(history: History, config: Config, newest_step: int | None,
            progressed: bool = False) -> History:
    """Clear the charges when the run made progress since the last one."""
    if not history.total_restarts or not made_progress(history, config, newest_step,
                                                       progressed):
        return history
    return replace(history, budgets_used={}, total_restarts=0,
                   forgiven=history.forgiven + history.total_restarts)


def exhausted(history: History, config: Config, name: str) -> str | None:
    """Which limit a relaunch charged to budget `name` would exceed, said for a person; None
    while both the total and the budget have room."""
    r = config.restart
    assert r.max_restarts is not None  # resolved by RestartConfig
    if history.total_restarts >= r.max_restarts:
        return (f"{history.total_restarts} relaunches after failures without progress in "
                f"between, the limit: {r.knob('max_restarts')}; raise it to allow more")
    used = history.budgets_used.get(name, 0)
    if used >= r.budgets[name]:
        return (f"the {name} budget is spent ({used} of {r.budgets[name]} relaunches after "
                f"{name} failures without progress in between): {r.knob(name)}; raise it to "
                "allow more")
    return None


def charge(history: History, name: str, newest_step: int | None) -> History:
    """Spend one relaunch of budget `name`; progress is counted afresh from here."""
    return replace(history, total_restarts=history.total_restarts + 1,
                   budgets_used={**history.budgets_used,
                                 name: history.budgets_used.get(name, 0) + 1},
                   charge_step=newest_step, progress_steps=0, progress_s=0.0)


def rate(history: History, config: Config, now: float) -> tuple[History, str | None]:
    """Record a failure at `now`; the alarm sentence when the hour holds too many."""
    times = (*(t for t in history.failure_times if now - t < HOUR_S), now)
    out = replace(history, failure_times=times)
    limit = config.restart.max_failures_per_hour
    if limit and len(times) > limit:
        return out, f"{len(times)} failures in the last hour, more than {limit}"
    return out, None


def count_progress(history: History, steps: int, seconds: float) -> History:
    """Add an attempt's training to the progress made since the last charge."""
    if steps <= 0:
        return history
    return replace(history, progress_steps=history.progress_steps + steps,
                   progress_s=history.progress_s + max(seconds, 0.0))
