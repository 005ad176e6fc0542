"""Optimizer hyper-parameters that differ between the script and the checkpoint at a restore.

Restoring loads the checkpoint's param groups, so the checkpoint's values replace what the
script's optimizer was built with. That is news when the person changed a value in the script
(a new weight decay): their value is silently not used. It is no news when the script sets the
value itself as it trains (a learning rate computed every step), which most single-file scripts
do; a warning on every resume there teaches people to ignore warnings.

The rule: the verdict waits for the second optimizer step after the restore (by then one whole
iteration ran, whatever its order: a value set before or after the step, or after the save, has
been set once). A key whose value in a group is no longer the one the restore left there was
set by the script since: it manages that key itself, and the difference is logged at info
level. The others stand: one warning line for the resume naming every key, its groups and
both values, collapsed when the groups agree. A script that stops before its second step (or
calls `close()` first) gets the verdict at `close()`. Under a scheduler the compared key is
`initial_lr` (the scheduler moves `lr`; the script chose the initial one).

Limit: a script that writes exactly the checkpoint's value again cannot be told from one that
writes nothing; it gets the warning (whose values then agree with what it trains with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

VERDICT_AT_STEP = 2  # the optimizer step (after the restore) whose start settles the verdict


@dataclass(frozen=True, slots=True)
class Change:
    """One hyper-parameter of one param group that the checkpoint replaced."""

    group: int
    key: str
    script: Any
    checkpoint: Any


def differences(saved_groups: list[dict[str, Any]],
                current_groups: list[dict[str, Any]]) -> list[Change]:
    """What loading `saved_groups` changes in the optimizer's `current_groups`."""
    out = []
    for gi, (saved, cur) in enumerate(zip(saved_groups, current_groups, strict=True)):
        for k, v in saved.items():
            if k in ("params", "initial_lr") or k not in cur:
                continue
            c = cur[k]
            if k == "lr" and "initial_lr" in saved and "initial_lr" in cur:
                # A scheduler moves lr; what the script chose is the initial lr.
                k, v, c = "initial_lr", saved["initial_lr"], cur["initial_lr"]
            if differs(c, v):
                out.append(Change(gi, k, _copy(c), _copy(v)))
    return out


def split(changes: list[Change], restored: dict[tuple[int, str], Any],
          current: dict[tuple[int, str], Any]) -> tuple[list[Change], list[Change]]:
    """(standing, managed): a change whose key the script has set since the restore (its value
    is no longer the restored one) is managed by the script; the others stand."""
    standing, managed = [], []
    for c in changes:
        at = (c.group, c.key)
        moved = at in restored and at in current and differs(current[at], restored[at])
        (managed if moved else standing).append(c)
    return standing, managed


def describe(changes: list[Change], n_groups: int) -> str:
    """`'lr' of all groups: script 0.001, checkpoint 0.0003; 'betas' of group 1: ...`: one
    clause per key, one per distinct pair of values when the groups disagree."""
    keys: dict[str, list[Change]] = {}
    for c in changes:
        keys.setdefault(c.key, []).append(c)
    parts = []
    for key, cs in keys.items():
        pairs: dict[tuple[str, str], list[int]] = {}
        for c in cs:
            pairs.setdefault((fmt(c.script), fmt(c.checkpoint)), []).append(c.group)
        for (script, ckpt), groups in pairs.items():
            parts.append(f"'{key}' of {_groups(groups, n_groups)}: script {script}, "
                         f"checkpoint {ckpt}")
    return "; ".join(parts)


def _groups(groups: list[int], n_groups: int) -> str:
    if len(groups) == n_groups and n_groups > 1:
        return "all groups"
    if len(groups) == 1:
        return f"group {groups[0]}"
    return "groups " + ", ".join(map(str, groups))


class Pending:
    """The verdict on one restore's changes, taken at the start of the optimizer's
    `VERDICT_AT_STEP`-th step after it (a step pre-hook), or at `settle()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, changes: list[Change]) -> None:
        self.optimizer, self.changes = optimizer, changes
        self.restored = _values(optimizer, changes)  # after the whole restore (lr_scale too)
        self.steps = 0
        self._handle: Any = optimizer.register_step_pre_hook(self._step)

    def _step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.steps >= VERDICT_AT_STEP:
            self.settle()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def settle(self) -> None:
        """Say what stands (warning) and what the script manages (info); once."""
        if self._handle is None:
            return
        self._handle.remove()
        self._handle = None
        standing, managed = split(self.changes, self.restored,
                                  _values(self.optimizer, self.changes))
        n = len(self.optimizer.param_groups)
        if standing:
            log.warning("optimizer hyper-parameters differ from the script's and the "
                        "checkpoint's values are used: %s", describe(standing, n))
        if managed:
            log.info("optimizer hyper-parameters the script sets itself after the restore "
                     "(the checkpoint's values were replaced): %s", describe(managed, n))


def _values(optimizer: torch.optim.Optimizer, changes: list[Change]
            ) -> dict[tuple[int, str], Any]:
    groups = optimizer.param_groups
    return {(c.group, c.key): _copy(groups[c.group][c.key]) for c in changes
            if c.group < len(groups) and c.key in groups[c.group]}


def _copy(v: Any) -> Any:
    # A tensor lr may be changed in place (`fill_`): keep what it held, not the object.
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def differs(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return list(a) != list(b)
    return a != b


def fmt(v: Any) -> str:
    return str(v.tolist()) if isinstance(v, torch.Tensor) else repr(v)
