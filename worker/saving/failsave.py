"""Save at the failure: when an exception ends the script before anything changed the model or
optimizer since the last step boundary, commit that boundary's checkpoint on the way out.

Most crashes (a Python exception, CUDA out of memory) are raised in the forward or backward pass,
before the optimizer has changed anything: the weights, optimizer, scheduler and GradScaler in
memory are still exactly the state after the last completed step. Only small things moved since:
the RNG states and the data position. At each step boundary (`maybe_save`) the Checkpointer keeps
those (`capture.Moving`, microseconds per step) and `Watch` marks what could change the rest:

- an optimizer step: a step pre-hook counts its start, so an exception raised half-way through
  `optimizer.step` (half the parameters updated) counts as a changed state;
- the model's tensors: each parameter's and buffer's version counter, which every in-place write
  bumps (BatchNorm's running statistics in a forward, a weight clamp outside the optimizer);
- the scheduler: its `last_epoch` and the learning rates it sets in the optimizer;
- the GradScaler: `update()` replaces its per-optimizer record (and changes the scale even when
  it skipped the optimizer step for inf gradients).

`decide` turns the marks at the boundary and at the failure into a `Verdict`; only `SAVE` writes.
Never saved: after SIGKILL, a segfault or `os._exit` (no Python runs); on KeyboardInterrupt
(Ctrl-C means now) or SystemExit (an exit chosen by the script or a guard: a non-finite loss wants
its rollback, not a checkpoint of the diverged state); under torch.distributed (a collective save
needs every rank, and the others are blocked in a collective or still training); when the
boundary is already committed. Not detected: in-place writes to optimizer state outside
`step`, and a model parameter or buffer replaced by a new tensor (the model's tensors are listed
at the first boundary; BatchNorm and the optimizers write in place).

The save is a normal, full checkpoint, written synchronously after any background save in flight
finished, within `timeout_s`: a save that hangs or fails is logged and the original exception
ends the process as before (the exit record keeps its kind).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from rtrain.worker import dist, quick_exit, runtime
from rtrain.worker.saving import hang_save

log = logging.getLogger(__name__)


class Verdict(str, Enum):
    """What a failure does with the kept boundary; only SAVE writes a checkpoint."""

    SAVE = "save"
    NOT_A_CRASH = "not_a_crash"  # KeyboardInterrupt, SystemExit: the exit was chosen
    DISTRIBUTED = "distributed"
    NO_BOUNDARY = "no_boundary"  # no maybe_save since the start (or the restore)
    ALREADY_SAVED = "already_saved"
    OPTIMIZER_STEPPED = "optimizer_stepped"
    MODEL_CHANGED = "model_changed"
    SCHEDULER_STEPPED = "scheduler_stepped"
    SCALER_UPDATED = "scaler_updated"


WHY = {
    Verdict.NOT_A_CRASH: "the exit was asked for",
    Verdict.DISTRIBUTED: "several processes train together (a save needs every rank)",
    Verdict.NO_BOUNDARY: "no step has completed in this process",
    Verdict.ALREADY_SAVED: "that step is already committed",
    Verdict.OPTIMIZER_STEPPED: "an optimizer step had started",
    Verdict.MODEL_CHANGED: "a model tensor was changed in place",
    Verdict.SCHEDULER_STEPPED: "the scheduler had stepped",
    Verdict.SCALER_UPDATED: "the GradScaler had updated",
}


@dataclass(frozen=True)
class Marks:
    """What could have changed the saved state, as seen at one moment."""

    optimizer_steps: int  # optimizer steps begun so far (the pre-hook's count)
    versions: tuple[int, ...]  # the model's parameters' and buffers' version counters
    scheduler: tuple[Any, ...]  # its last_epoch and the optimizer's learning rates
    scaler: int | None  # identity of the GradScaler's per-optimizer record


def decide(exc: BaseException, *, boundary: int | None, at_boundary: Marks | None, now: Marks,
           committed: Collection[int], distributed: bool) -> Verdict:
    """Whether the failure `exc` may commit the boundary step, and if not, why not."""
    if not isinstance(exc, Exception):
        return Verdict.NOT_A_CRASH
    if distributed:
        return Verdict.DISTRIBUTED
    if boundary is None or at_boundary is None:
        return Verdict.NO_BOUNDARY
    # Only the boundary's own checkpoint makes the save redundant. A newer one can exist: an
    # earlier attempt's that this one did not resume from (damaged, or set aside by rtrain),
    # and the boundary is then exactly what the relaunch needs.
    if boundary in committed:
        return Verdict.ALREADY_SAVED
    if now.optimizer_steps != at_boundary.optimizer_steps:
        return Verdict.OPTIMIZER_STEPPED
    if now.versions != at_boundary.versions:
        return Verdict.MODEL_CHANGED
    if now.scheduler != at_boundary.scheduler:
        return Verdict.SCHEDULER_STEPPED
    if now.scaler != at_boundary.scaler:
        return Verdict.SCALER_UPDATED
    return Verdict.SAVE


class Watch:
    """Marks for one Checkpointer's model, optimizer, scheduler and scaler."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
                 scheduler: Any, scaler: Any) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = (model, optimizer, scheduler,
                                                                   scaler)
        self.steps_begun = 0
        self._tensors: list[torch.Tensor] | None = None
        self._handle = None
        if optimizer is not None:
            # A pre-hook, not a post-hook: a step that raised half-way has begun, and must
            # count as having changed the state.
            self._handle = optimizer.register_step_pre_hook(self._step_begins)

    def _step_begins(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps_begun += 1
        with hang_save.hold_steps:  # a save at a hang in flight ends before a step writes
            pass

    def marks(self) -> Marks:
        if self._tensors is None:
            # Listed once: walking the modules costs ~3 us per tensor, reading a version 0.25.
            self._tensors = [] if self.model is None else [*self.model.parameters(),
                                                           *self.model.buffers()]
        versions = tuple(map(_VERSION, self._tensors))
        sched: tuple[Any, ...] = ()
        if self.scheduler is not None:
            sched = (getattr(self.scheduler, "last_epoch", None),)
        if self.optimizer is not None:
            sched += tuple(_lr(g.get("lr")) for g in self.optimizer.param_groups)
        # update() replaces the record with a new dict; the scaler holds no other state a step
        # changes outside the optimizer step (unscale_ works on gradients, which no save holds).
        record = getattr(self.scaler, "_per_optimizer_states", None)
        return Marks(self.steps_begun, versions, sched,
                     id(record) if record is not None else None)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


_VERSION = torch.Tensor._version.__get__  # bumped by every in-place write to the tensor


def _lr(lr: Any) -> Any:
    # A tensor lr (capturable optimizers) compares by its version: reading it would sync.
    return ("tensor", id(lr), lr._version) if isinstance(lr, torch.Tensor) else lr


def run_bounded(save: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
    """Run `save` in a daemon thread for at most `timeout_s`: (finished, its result). An error
    it raised is its result; past the deadline the thread is left behind (the process is
    ending: a daemon thread does not hold it, and an unfinished save leaves only a temp dir)."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(save())
        except BaseException as e:  # handed back: the caller logs it and the crash goes on
            box.append(e)

    t = threading.Thread(target=target, name="rtrain-save-at-failure", daemon=True)
    t.start()
    t.join(timeout_s)
    return (bool(box), box[0] if box else None)


# ------------------------------------------------------------------ the excepthook

_watched: weakref.WeakSet = weakref.WeakSet()  # Checkpointers that save at a failure
_installed = False


def watch(ckpt: Any) -> None:
    """Have an uncaught exception call `ckpt.save_on_failure(exc)` before the previous
    excepthook (which prints the traceback, and writes the exit record if one is installed)."""
    global _installed
    _watched.add(ckpt)
    hang_save.start(lambda: list(_watched))
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], exc: BaseException, tb: Any) -> None:
        # When the failure happened, for its cost: the way out (this save, the interpreter's
        # shutdown) is part of it.
        runtime.heartbeat(event="exception", reason=tp.__name__,
                          peer_lost=True if dist.peer_lost(exc) else None)
        # Ctrl-C means now: not even a save in flight is waited for (decide says the same).
        for c in list(_watched) if isinstance(exc, Exception) else []:
            try:
                c.save_on_failure(exc)
            except BaseException as e:  # never mask the exception that is ending the script
                log.error("the save at the failure failed: %s: %s", type(e).__name__, e)
        previous(tp, exc, tb)
        quick_exit.after_uncaught()  # the relaunch waits for this process's end

    sys.excepthook = hook


def distributed() -> bool:
    """Several processes train together (an initialised group, or torchrun's WORLD_SIZE)."""
    group = torch.distributed.is_available() and torch.distributed.is_initialized()
    return group or int(os.environ.get("WORLD_SIZE") or 1) > 1
