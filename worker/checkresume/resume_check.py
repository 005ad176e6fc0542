"""What `rtrain check-resume` learns inside the training process; off unless RTRAIN_CHECK_RESUME
is set (only check-resume sets it), and then it costs two RNG fingerprints per step.

The command runs the script straight to its end, and again stopped at a step and resumed, and
compares the final checkpoints. When they differ it names likely causes from the evidence this
probe writes into every manifest (`info.check_resume`, schema below):

- what moved between `optimizer.step()` and `maybe_save()`: torch's (CPU, CUDA), python's and
  numpy's global generators, and the data position. A batch drawn there (a prefetch) is consumed
  by the next step, but the checkpoint holds the generator and position after it and not the
  batch, so a resumed run trains on another one. An optimizer step post-hook takes the
  fingerprint; the boundary compares.
- a DataLoader that was mid-epoch at a save but not handed to the Checkpointer (`loader=`, the
  loader or its sampler): its position is lost. `DataLoader.__iter__` is wrapped to see
  every iterator; an iterator that ran to its end (an evaluation loader) is not counted.
- a bare sampler as `loader=` of a loader that has workers (exact only with `num_workers=0`).
- seeding after `restore()` loaded a checkpoint (`torch.manual_seed`, `random.seed`,
  `np.random.seed`, `set_rng_state`, ... called from the script's code): the restored RNG state
  is replaced, so dropout and everything else drawn from it differs.
- the model's RNG-consuming modules in training mode (dropout, RReLU, attention dropout).
- the device, and whether deterministic algorithms are on (CUDA kernels may not reproduce).

Orders from the command (parsed in worker/checkresume/check_order.py, torch-free, with the entropy a
process starts from): `stop_at` N with `stop` "kill" (at the first boundary at or past N:
save, then SIGKILL the process group, as a lost node) or "signal" (send the stop signal,
SIGTERM, to the process group: the Checkpointer saves at that boundary and exits 75, the
preemption path). Without a stop, `close()` (or the interpreter's exit) saves the last boundary's
step, so the final state is always in a checkpoint.

info.check_resume (version 1): v, boundaries (maybe_save calls seen), moved_after_step ({"torch",
"cuda", "python", "numpy", "data": boundaries at which it had moved since the optimizer step}),
first_moved_step, loaders_not_handed (["DataLoader: 3 of 10 batches taken"]),
sampler_with_workers (bool), rng_modules (["net.2 (Dropout p=0.3)"]), reseeded
(["train.py:41 torch.manual_seed"]), restored_step (the step restore() loaded, else null),
device, deterministic, cudnn_benchmark, stopped ("kill", "signal" or null: this save is the
stop's).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import random
import signal
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

import rtrain.worker
from rtrain.supervisor.core.errors import CheckpointError
from rtrain.supervisor.core.protocol import ENV_CKPT_DIR
from rtrain.worker import runtime
from rtrain.worker.checkresume.check_order import Plan

VERSION = 1
_MOVING = ("torch", "cuda", "python", "numpy", "data")
_NAMES = 8  # modules, loaders and call sites listed at most


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(t.numpy().tobytes(), digest_size=8).digest()


def fingerprint(samples_seen: int | None) -> dict[str, Any]:
    """Every global generator's state and the data position, small enough to keep per step."""
    _, keys, *rest = np.random.get_state(legacy=True)
    fp: dict[str, Any] = {"torch": _digest(torch.get_rng_state()),
                          "python": hash(random.getstate()),
                          "numpy": (hashlib.blake2b(keys.tobytes(), digest_size=8).digest(),
                                    *rest),
                          "data": samples_seen}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        fp["cuda"] = tuple(_digest(s.cpu()) for s in torch.cuda.get_rng_state_all())
    return fp


def moved(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Which of the fingerprint's parts differ."""
    return [k for k in _MOVING if before.get(k) != now.get(k)]


def rng_modules(model: torch.nn.Module | None) -> list[str]:
    """The model's modules that draw from the RNG in training mode, as `name (Type p=...)`."""
    from torch import nn
    from torch.nn.modules.dropout import _DropoutNd

    out = []
    for name, m in model.named_modules() if model is not None else ():
        if not m.training:
            continue
        if isinstance(m, _DropoutNd) and m.p > 0:
            out.append(f"{name} ({type(m).__name__} p={m.p:g})")
        elif isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            out.append(f"{name} ({type(m).__name__} dropout={m.dropout:g})")
        elif isinstance(m, nn.RReLU):
            out.append(f"{name} (RReLU)")
    return out


# ------------------------------------------------------------------ process-wide watches

_probes: weakref.WeakSet = weakref.WeakSet()
_iterators: list[tuple[weakref.ref, weakref.ref]] = []  # (loader, its iterator)
_patched = False
# Calls from these places are the libraries' own (fork_rng, the Checkpointer's restore): all of
# the worker's folders, not this module's alone.
_OWN = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
             for f in (torch.__file__, np.__file__, rtrain.worker.__file__))
_OWN_FILES = (random.__file__,)


def _patch() -> None:
    """Wrap DataLoader.__iter__ and the seeding functions, once per process."""
    global _patched
    if _patched:
        return
    _patched = True
    from torch.utils.data import DataLoader

    original_iter = DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        it = original_iter(self)
        _iterators[:] = [(lr, ir) for lr, ir in _iterators if lr() is not None
                         and ir() is not None and ir() is not it]
        try:
            _iterators.append((weakref.ref(self), weakref.ref(it)))
        except TypeError:  # an iterator without weak references: not watched
            pass
        return it

    DataLoader.__iter__ = __iter__
    seeders = [(torch, "manual_seed", "torch.manual_seed"), (torch, "seed", "torch.seed"),
               (torch, "set_rng_state", "torch.set_rng_state"),
               (torch.random, "manual_seed", "torch.random.manual_seed"),
               (torch.random, "set_rng_state", "torch.random.set_rng_state"),
               (torch.cuda, "manual_seed", "torch.cuda.manual_seed"),
               (torch.cuda, "manual_seed_all", "torch.cuda.manual_seed_all"),
               (torch.cuda, "set_rng_state", "torch.cuda.set_rng_state"),
               (random, "seed", "random.seed"), (random, "setstate", "random.setstate"),
               (np.random, "seed", "np.random.seed"), (np.random, "set_state",
                                                       "np.random.set_state")]
    for module, attr, label in seeders:
        setattr(module, attr, _seeder(getattr(module, attr), label))


def _seeder(fn: Any, label: str) -> Any:
    @functools.wraps(fn)
    def seeding(*args: Any, **kwargs: Any) -> Any:
        frame = sys._getframe(1)
        where = frame.f_code.co_filename
        if not where.startswith(_OWN) and where not in _OWN_FILES:
            for p in list(_probes):
                p.seeded(f"{Path(where).name}:{frame.f_lineno} {label}")
        return fn(*args, **kwargs)

    return seeding


def _stop_group(sig: signal.Signals) -> None:
    """`sig` to this process's group when it leads one (check-resume starts it in a session
    of its own, with its loader workers), else to this process alone."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), sig)
    else:
        os.kill(os.getpid(), sig)


class Probe:
    """One Checkpointer's evidence and orders under check-resume (`ckpt` is the Checkpointer:
    this unit gets it handed in and uses its public methods only)."""

    def __init__(self, ckpt: Any, order: Plan) -> None:
        given = os.environ.get(ENV_CKPT_DIR)
        if given and Path(ckpt.ckpt_dir).resolve() != Path(given).resolve():
            raise CheckpointError(
                f"rtrain check-resume: this Checkpointer saves to {str(ckpt.ckpt_dir)!r}, not to "
                "the checkpoint dir check-resume gives each run (RTRAIN_CKPT_DIR): leave "
                "ckpt_dir unset, or pass {ckpt_dir} in the script's arguments")
        self.ckpt, self.order = ckpt, order
        self.boundaries = 0
        self.last_step: int | None = None
        self.moved = dict.fromkeys(_MOVING, 0)
        self.first_moved_step: int | None = None
        self.not_handed: list[str] = []
        self.sampler_with_workers = False
        self.reseeded: list[str] = []
        self.restored_step: int | None = None
        self.stopped: str | None = None
        self.finished = False
        self._after_step: dict[str, Any] | None = None
        self._handle = None
        if ckpt.optimizer is not None:
            self._handle = ckpt.optimizer.register_step_post_hook(self._stepped)
        _patch()
        _probes.add(self)
        atexit.register(self._at_exit)

    def _samples(self) -> int | None:
        data = self.ckpt.data
        return data.samples_seen if data is not None else None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._after_step = fingerprint(self._samples())

    def seeded(self, where: str) -> None:
        if self.restored_step is not None and where not in self.reseeded:
            self.reseeded.append(where)

    def restored(self, step: int) -> None:
        self.restored_step = step

    def boundary(self, step: int) -> None:
        """At `maybe_save(step)`, before its save: what moved since the optimizer step; then the
        stop, if this is the step to stop at."""
        self.boundaries += 1
        self.last_step = step
        if self._after_step is not None:
            what = moved(self._after_step, fingerprint(self._samples()))
            for k in what:
                self.moved[k] += 1
            if what and self.first_moved_step is None:
                self.first_moved_step = step
            self._after_step = None
        o = self.order
        if o.stop_at is None or step < o.stop_at or self.stopped:
            return
        self.stopped = o.stop
        if o.stop == "signal":
            # The handler sets the stop flag (another thread may take the signal: wait for the
            # flag); this maybe_save then sees the stop, saves and exits 75.
            _stop_group(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not runtime.should_stop() and time.monotonic() < deadline:
                time.sleep(0.001)
            return
        self.ckpt.save(step)
        self.ckpt.close()  # an async save commits before the kill
        sys.stdout.flush()
        sys.stderr.flush()
        _stop_group(signal.SIGKILL)

    def _loaders(self) -> None:
        """Note loaders mid-epoch now that the Checkpointer does not hold the position of."""
        ckpt_sampler = self.ckpt.sampler
        for loader_ref, it_ref in list(_iterators):
            loader, it = loader_ref(), it_ref()
            if loader is None or it is None:
                continue
            sampler = getattr(loader, "sampler", None)
            batch_sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
            if getattr(loader, "_rtrain_position", None) is not None:
                continue
            if ckpt_sampler is not None and ckpt_sampler in (sampler, batch_sampler):
                self.sampler_with_workers |= getattr(loader, "num_workers", 0) > 0
                continue
            taken = getattr(it, "_num_yielded", 0)
            try:
                length: int | None = len(it)
            except TypeError:
                length = None
            if taken and (length is None or taken < length):
                what = f"{type(loader).__name__}: {taken} of {length or '?'} batches taken"
                if what not in self.not_handed and len(self.not_handed) < _NAMES:
                    self.not_handed.append(what)

    def evidence(self) -> dict[str, Any]:
        """info.check_resume of a save now (schema: the module docstring)."""
        self._loaders()
        model = self.ckpt.model
        p = next(iter(model.parameters()), None) if model is not None else None
        return {
            "v": VERSION, "boundaries": self.boundaries,
            "moved_after_step": {k: n for k, n in self.moved.items() if n},
            "first_moved_step": self.first_moved_step,
            "loaders_not_handed": list(self.not_handed),
            "sampler_with_workers": self.sampler_with_workers,
            "rng_modules": rng_modules(model)[:_NAMES],
            "reseeded": self.reseeded[:_NAMES],
            "restored_step": self.restored_step,
            "device": p.device.type if p is not None else "cpu",
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "stopped": self.stopped,
        }

    def finish(self) -> None:
        """At `close()`: the last boundary's step into a checkpoint (unless this process
        stopped), so the run's final state is what check-resume compares."""
        if self.finished or self.stopped:
            return
        self.finished = True
        atexit.unregister(self._at_exit)
        if self._handle is not None:
            self._handle.remove()
        if self.last_step is not None:
            self.ckpt.save(self.last_step)  # returns at once when that step is saved

    def _at_exit(self) -> None:
        # A script that never calls close(): its final state is saved as it exits.
        if not self.finished and not self.stopped:
            self.ckpt.close()
