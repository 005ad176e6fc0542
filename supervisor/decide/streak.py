"""The checkpoint an attempt resumed from, and the streak of attempts that failed the same way
from one checkpoint: `quarantine_streak`, a pure function policy.decide calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.failures import OUT_OF_MEMORY, FailureKind
from rtrain.supervisor.decide.history import History
from rtrain.supervisor.decide.observation import Observation


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """The checkpoint an attempt resumed from."""

    path: str
    id: str  # tells a checkpoint from a later one saved under the same name (quarantine.py)
    step: int | None


# Signals sent from outside (a person, a scheduler, a killer): what they end says nothing about
# the checkpoint. Kills cluster at saves (the slowest moments), so their steps often match.
_OUTSIDE_SIGNALS = {"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"}


def own_failure_step(ev: Observation | None) -> int | None:
    """The step at which the attempt failed by itself (an exception, NaN, a crash signal, a
    hang); None when it was killed from outside or never trained."""
    if ev is None or (ev.signal in _OUTSIDE_SIGNALS and not ev.hang):
        return None
    return ev.last_step


def killed_while_training(ev: Observation | None, resumed_step: int | None,
                          trained_s: float) -> bool:
    """Killed from outside (a person, a scheduler, a killer; not rtrain's stop at a hang) after
    it trained: past the step it resumed from (a script that sends heartbeats), or for
    `trained_s` seconds (one that sends none). Such an ending says nothing about the script,
    so it is no part of a crash loop: the budgets count it."""
    if ev is None or ev.hang or ev.signal not in _OUTSIDE_SIGNALS:
        return False
    if ev.heartbeats.count:
        return ev.last_step is not None and ev.last_step > (resumed_step or 0)
    return ev.duration_s >= trained_s


def quarantine_streak(history: History, config: Config, kind: FailureKind,
                      resumed: Resumed | None, committed: bool,
                      last_step: int | None) -> tuple[History, dict[str, Any] | None]:
    """Count consecutive attempts that resumed from one checkpoint, trained, and failed the
    same way at the same step before committing anything newer: what a poisoned state or data
    position does, and what random outside kills (or deaths during start-up, before the
    checkpoint was even used) do not. At `quarantine_after` the checkpoint is quarantined
    (returned) and the streak starts over."""
    k = config.restart.quarantine_after
    # Out of memory at the same step is the settings' fault, which the ladder changes.
    if not k or kind in OUT_OF_MEMORY or resumed is None or committed or last_step is None:
        return replace(history, streak=None), None
    old = history.streak or {}
    same = (old.get("id"), old.get("kind"), old.get("last_step")) == (resumed.id, kind.value,
                                                                      last_step)
    count = old.get("count", 0) + 1 if same else 1
    if count < k:
        return replace(history, streak={"path": resumed.path, "id": resumed.id,
                                        "step": resumed.step, "kind": kind.value,
                                        "last_step": last_step, "count": count}), None
    entry = {"path": resumed.path, "id": resumed.id, "step": resumed.step,
             "reason": f"{count} attempts in a row resumed from it and failed ({kind.value}) "
                       f"at step {last_step}, before committing a newer checkpoint"}
    return replace(history, streak=None, quarantined=(*history.quarantined, entry)), entry
