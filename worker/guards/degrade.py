"""Degrading inside the process, before a restart is needed (issue 4).

- `NonFiniteGuard`: skip a step whose loss or gradients are NaN/Inf; end as `nonfinite` after K
  in a row.
- `OOMBackoff`: retry a step that ran out of GPU memory as smaller micro-batches with gradient
  accumulation; the smaller size sticks and is reported, so the supervisor's ladder starts there.
- `SkipBadSamples` + `skip_none_collate`: drop samples that fail to load; end as `data` when too
  many do.
- `install_excepthook()`: an uncaught exception leaves an exit record naming its kind.

Each writes the exit record (contract 2) itself before ending the attempt, with the settings the
process actually used (`effective_settings()`), so the supervisor can adopt them.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rtrain.worker import quick_exit, runtime
from rtrain.worker.settings import current as env_settings

log = logging.getLogger(__name__)

EXIT_NONFINITE = 1
_overrides: dict[str, Any] = {}  # knobs changed in-process (OOM back-off), over RTRAIN_SETTINGS


def effective_settings(base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The supervisor's settings (or `base`) with what an in-process back-off changed."""
    return {**(env_settings() if base is None else base), **_overrides}


def _recorded(exc: BaseException) -> BaseException:
    # Tells install_excepthook that this exception's exit record is already written.
    exc._rtrain_recorded = True
    return exc


# ------------------------------------------------------------------ non-finite


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    # One flag per device and one sync at the end, not a sync per tensor.
    flags: dict[torch.device, torch.Tensor] = {}
    for t in tensors:
        ok = torch.isfinite(t).all()
        flags[t.device] = ok if t.device not in flags else flags[t.device] & ok
    return all(bool(f) for f in flags.values())


class NonFiniteGuard:
    """Skip steps whose loss (or gradients) are not finite; K in a row end the attempt.

        guard = rtrain.NonFiniteGuard(max_consecutive=5)
        loss.backward()
        if not guard.skip(loss, model=model, step=step):
            optimizer.step()
        optimizer.zero_grad()

    `skip` returns True when the caller must not step the optimizer. With `model`, the gradients
    are checked too and, on a skip, dropped (set to None). With an enabled GradScaler only the
    loss is checked: gradient overflow is the scaler's own business (its `step` skips and its
    `update` backs off); a non-finite loss backs the scale off here, since `scaler.step` is not
    called. After `max_consecutive` skips in a row, the exit record says `nonfinite` and the
    process exits 1, so the supervisor rolls back (and cuts the `lr` knob).
    """

    def __init__(self, max_consecutive: int = 5) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be at least 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0  # over the whole attempt

    def skip(self, loss: torch.Tensor | float, model: torch.nn.Module | None = None,
             scaler: Any = None, step: int | None = None) -> bool:
        scaling = scaler is not None and scaler.is_enabled()
        tensors = [torch.as_tensor(loss)]
        if model is not None and not scaling:
            tensors += [p.grad for p in model.parameters() if p.grad is not None]
        if _all_finite(tensors):
            self.consecutive = 0
            return False
        self.consecutive += 1
        self.skipped += 1
        if model is not None:
            for p in model.parameters():
                p.grad = None
        if scaling:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        log.warning("step %s: non-finite loss or gradients, step skipped (%d in a row, %d in "
                    "all)", step, self.consecutive, self.skipped)
        if self.consecutive >= self.max_consecutive:
            reason = (f"loss or gradients non-finite for {self.consecutive} consecutive steps "
                      f"(last at step {step})")
            log.error("%s: ending the attempt", reason)
            runtime.write_exit_record("nonfinite", reason, step=step,
                                      settings=_overrides or None, skipped_steps=self.skipped)
            raise SystemExit(EXIT_NONFINITE)
        return True


# ------------------------------------------------------------------ out of memory


def is_gpu_oom(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) out-of-memory error, as torch raises it."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(exc, oom) or (isinstance(exc, RuntimeError)
                                    and "out of memory" in str(exc))


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_len(batch[0])
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}: use tensors, or "
                    "tuples, lists or dicts of them")


def _slice(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[lo:hi]
    if isinstance(batch, dict):
        return {k: _slice(v, lo, hi) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, lo, hi) for v in batch)
    return batch  # non-tensor leaves (names, flags) are shared by every micro-batch


class OOMBackoff:
    """Run forward+backward for a batch; on a GPU out-of-memory error, split it and go on.

        backoff = rtrain.OOMBackoff(settings=s)       # s = rtrain.settings(batch_size=..., ...)
        loss = backoff.run(lambda mb: F.cross_entropy(model(mb[0]), mb[1]), (x, y))
        optimizer.step()

    `loss_fn(micro_batch)` returns the *mean* loss of its micro-batch; `run` calls
    `backward(loss * len(micro)/len(batch))` (default `.backward()`; pass
    `backward=lambda l: scaler.scale(l).backward()` with a GradScaler), so the gradients sum to
    the full batch's, the same result up to float rounding. It returns the batch's mean loss,
    detached. On an out-of-memory error the micro-batch size halves, the allocator cache is
    freed, and the samples not yet done are run at the new size; the size sticks for later
    batches and is reported (heartbeat `settings`, exit record) as `knob` with `accum_knob`
    multiplied to keep the effective batch. At micro-batch 1 the error is re-raised.
    A relieve request from rtrain (memory pressure, worker/runtime.py) halves the micro-batch
    the same way before an error happens.

    An error raised in the middle of a backward pass may leave part of that micro-batch's
    gradient accumulated; the usual out-of-memory errors come in the forward or at the start of
    the backward, where nothing has been accumulated yet.
    """

    def __init__(self, *, settings: dict[str, Any] | None = None, knob: str = "batch_size",
                 accum_knob: str = "grad_accum") -> None:
        self.settings = dict(env_settings() if settings is None else settings)
        self.knob, self.accum_knob = knob, accum_knob
        self.micro: int | None = None  # None: whole batches
        self.backoffs = 0
        self._last_n: int | None = None  # size of the last batch run
        runtime.on_pressure(self.relieve)

    def relieve(self) -> str | None:
        """Memory pressure: halve the micro-batch now (what an out-of-memory error would do)."""
        size = self.micro or self._last_n or self.settings.get(self.knob)
        if not isinstance(size, int) or size <= 1:
            return None
        self._shrink(size, "under memory pressure")
        return f"micro-batch {size} -> {self.micro}"

    def run(self, loss_fn: Callable[[Any], torch.Tensor], batch: Any,
            backward: Callable[[torch.Tensor], Any] | None = None) -> torch.Tensor:
        n = _batch_len(batch)
        self._last_n = n
        done, total = 0, None
        while done < n:
            size = min(self.micro or n, n - done)
            oom = False
            try:
                loss = loss_fn(_slice(batch, done, done + size))
                scaled = loss * (size / n)
                if backward is None:
                    scaled.backward()
                else:
                    backward(scaled)
                part = loss.detach() * (size / n)
                total = part if total is None else total + part
                done += size
            except RuntimeError as e:  # torch.OutOfMemoryError is one
                if not is_gpu_oom(e) or size <= 1:
                    raise
                oom = True
            # Outside the except block: the traceback (and the graph its frames hold) is gone.
            if oom:
                loss = scaled = None
                self._shrink(size, "out of GPU memory")
        assert total is not None
        return total

    def _shrink(self, size: int, why: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.micro = max(1, size // 2)
        self.backoffs += 1
        base = self.settings.get(self.knob)
        changed: dict[str, Any] = {self.knob: self.micro}
        if isinstance(base, int) and base > 0:
            accum = self.settings.get(self.accum_knob)
            if isinstance(accum, int) and accum > 0:
                changed[self.accum_knob] = accum * math.ceil(base / self.micro)
        _overrides.update(changed)
        log.warning("%s at micro-batch %d: going on as micro-batches of %d with gradient "
                    "accumulation (now %s)", why, size, self.micro, changed)
        runtime.heartbeat(event="backoff", settings=effective_settings(self.settings))


# ------------------------------------------------------------------ bad samples


class DataError(RuntimeError):
    """Too many samples failed to load."""


class SkipBadSamples(torch.utils.data.Dataset):
    """Wrap a map-style dataset: a sample whose load raises becomes None (dropped by
    `skip_none_collate`), counted and logged. Once `min_samples` were fetched, a failure rate
    above `max_rate` writes a `data` exit record and raises DataError.

    With DataLoader workers, each worker process counts its own share.
    """

    def __init__(self, dataset: Any, max_rate: float = 0.01, min_samples: int = 100,
                 errors: tuple[type[BaseException], ...] = (Exception,)) -> None:
        self.dataset, self.max_rate, self.min_samples = dataset, max_rate, min_samples
        self.errors = errors
        self.fetched = 0
        self.bad = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        self.fetched += 1
        try:
            return self.dataset[index]
        except self.errors as e:
            self.bad += 1
            log.warning("sample %s skipped: %s: %s (%d bad of %d)", index, type(e).__name__, e,
                        self.bad, self.fetched)
            if self.fetched >= self.min_samples and self.bad / self.fetched > self.max_rate:
                reason = (f"{self.bad} of {self.fetched} samples failed to load "
                          f"({self.bad / self.fetched:.1%} > {self.max_rate:.1%}); last: "
                          f"sample {index}: {type(e).__name__}: {e}")
                runtime.write_exit_record("data", reason, exception=e,
                                          bad_samples=self.bad, fetched=self.fetched)
                raise _recorded(DataError(reason)) from e
            return None


def skip_none_collate(batch: list[Any]) -> Any:
    """`default_collate` without the samples SkipBadSamples turned into None; None if none is
    left (skip that batch)."""
    kept = [b for b in batch if b is not None]
    return torch.utils.data.default_collate(kept) if kept else None


# ------------------------------------------------------------------ uncaught exceptions


def exit_kind(exc: BaseException) -> str:
    if is_gpu_oom(exc):
        return "oom_gpu"
    if isinstance(exc, MemoryError):
        return "oom_host"
    return "crash"


def install_excepthook() -> None:
    """Make an uncaught exception leave an exit record (oom_gpu, oom_host or crash, with the
    settings in force), then run the previous hook (the traceback still prints)."""
    previous = sys.excepthook
    if getattr(previous, "_rtrain", False):
        return

    def hook(tp: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not isinstance(exc, KeyboardInterrupt) and not getattr(exc, "_rtrain_recorded",
                                                                   False):
            try:
                runtime.write_exit_record(exit_kind(exc), f"{tp.__name__}: {exc}"[:500],
                                          exception=exc, settings=_overrides or None)
            except OSError as e:  # the record is a courtesy: the exit code still tells
                log.warning("could not write the exit record: %s", e)
        previous(tp, exc, tb)
        quick_exit.after_uncaught()  # the relaunch waits for this process's end

    hook._rtrain = True
    sys.excepthook = hook
