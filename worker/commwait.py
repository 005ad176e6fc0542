"""How long this rank waited for the others inside DDP's gradient all-reduce: the straggler
rule's in-step wait.

Ranks synchronise inside backward, where DDP all-reduces each gradient bucket. A rank slower
in its forward or backward makes the others wait there, not at the Checkpointer's step
boundary, so the boundary wait alone leaves every rank equally busy. Here a DDP communication
hook wraps the one that reduces the buckets (DDP's default all-reduce, or the script's own) and
reads the clock twice per bucket: when the bucket's collective is launched, and when its future
completes. After the backward's last bucket is launched the rank has nothing left to compute;
until the last bucket completes it only waits. That span, per backward, is the wait reported
(earlier buckets' collectives overlap the backward's own work and are not a wait).

Installed by the Checkpointer when handed a DDP model whose parameters are on the CPU (gloo):
on GPUs a future completes when the collective is queued on the stream, so host clocks would
not see the GPU's wait. DDP takes one hook per model, so:

- a model without a hook gets rtrain's, reducing as DDP's built-in reduction does (times
  1/world, then a sum): the same gradients bit for bit;
- a hook the script registers later (`model.register_comm_hook`) replaces the inner one and
  runs, timed, instead of DDP refusing a second hook;
- a hook registered before the Checkpointer cannot be wrapped: the log says so once, and the
  rule sees only the step-boundary wait, as before.

The cost per bucket is two clock reads and a lock taken twice (and, around a script's hook, one
chained future); no collective of its own (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

Hook = Callable[[Any, Any], Any]


class CommWaits:
    """The timed hook of one DDP model, and the waits it measured since the last `take`."""

    def __init__(self, state: Any, inner: Hook | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # `inner` None: DDP's default all-reduce over the process group `state`.
        self.state, self.inner, self._clock = state, inner, clock
        self._lock = threading.Lock()  # completions run on the process group's threads
        self._pending = 0  # buckets launched in this backward and not complete yet
        self._last_launch: float | None = None  # the backward's last bucket, launched
        self._newest_done = 0.0
        self._waited = 0.0

    def hook(self, state, bucket):  # DDP checks the names, and annotations if any
        """DDP's comm hook: the inner hook, timed (`state` is unused: the inner hook's is kept
        here, and replaced with it)."""
        if self.inner is None:
            return self._mean(bucket)
        fut = self.inner(self.state, bucket)
        self.launched(bucket)

        def done(f: Any) -> Any:
            self.completed(self._clock())
            return f.value()

        return fut.then(done)

    def _mean(self, bucket: Any) -> Any:
        """DDP's built-in reduction: each gradient times 1/world (as DDP's C++ reducer scales
        it; torch's `allreduce_hook` divides, which rounds differently when the world is not a
        power of two), then a sum; the completion is read in the callback the future needs
        anyway: one chained future, not two."""
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.state.size())
        fut = torch.distributed.all_reduce(buffer, group=self.state, async_op=True).get_future()
        self.launched(bucket)

        def done(f: Any) -> Any:
            self.completed(self._clock())
            return f.value()[0]

        return fut.then(done)

    def launched(self, bucket: Any) -> None:
        """The bucket's collective is under way."""
        launched, last = self._clock(), bucket.is_last()
        with self._lock:
            self._pending += 1
            if last:
                self._last_launch = launched

    def completed(self, now: float) -> None:
        """A bucket's collective completed at `now`; after the backward's last one, the time
        since its last bucket was launched is this rank's wait."""
        with self._lock:
            self._pending -= 1
            self._newest_done = max(self._newest_done, now)
            if self._pending == 0 and self._last_launch is not None:
                self._waited += max(0.0, self._newest_done - self._last_launch)
                self._last_launch, self._newest_done = None, 0.0

    def take(self) -> float:
        """The seconds waited since the previous call."""
        with self._lock:
            waited, self._waited = self._waited, 0.0
        return waited


def install(model: Any) -> CommWaits | None:
    """Time `model`'s gradient all-reduce when it is a DDP model on the CPU that rtrain can
    wrap (module docstring); None otherwise."""
    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp) or getattr(model, "_use_python_reducer", False):
        return None
    if any(p.device.type != "cpu" for p in model.parameters()):
        return None
    hooks = getattr(model, "_comm_hooks", None)
    if hooks and isinstance(getattr(hooks[0][0], "__self__", None), CommWaits):
        return hooks[0][0].__self__  # a Checkpointer before this one timed it: the same waits
    if hooks:
        names = ", ".join(getattr(h, "__qualname__", repr(h)) for h, _ in model._comm_hooks)
        log.warning("the DDP model has a comm hook already (%s): the straggler rule sees only "
                    "the step-boundary wait; register the hook after creating the Checkpointer "
                    "and rtrain times it", names)
        return None
    waits = CommWaits(model.process_group, None)
    try:
        model.register_comm_hook(None, waits.hook)
    except RuntimeError as e:  # a built-in hook (register_builtin_comm_hook) holds the place
        log.warning("the straggler rule sees only the step-boundary wait: DDP took no comm "
                    "hook (%s)", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None

    def register_comm_hook(state: object, hook: Callable) -> None:
        # The script's own hook, registered after rtrain's: it takes the inner place, so it
        # runs (timed) where DDP would refuse a second hook.
        model._check_comm_hook(hook)
        model.logger._set_comm_hook_name(hook.__qualname__)
        waits.state, waits.inner = state, hook

    model.register_comm_hook = register_comm_hook
    return waits
