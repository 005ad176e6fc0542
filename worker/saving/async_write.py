"""Saving in the background (`Saving(async_mode=...)`): at most one save in flight while
training goes on.

The training thread is blocked only while the state is snapshotted, one of two ways:
- fork: a child process writes from its copy-on-write view of memory, so the snapshot costs
  only the fork (page tables). For state in host memory, one process (no process group), and
  not in shared memory (the live state): a forked child would see that change, not a copy.
- thread: tensors are copied into reused (pinned, when CUDA is there) CPU buffers, which a
  thread writes. For CUDA state, and always under torch.distributed.
An error in the background is kept and raised by the next `wait` (the next save, or close):
never dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch

from rtrain.supervisor.core.errors import CheckpointError
from rtrain.worker import dist, runtime
from rtrain.worker.saving.save_target import Capture, SaveTarget

_CHILD_SKIPPED = 3  # the forked writer's exit code for a save skipped (storage error, no space)

Write = Callable[[Capture], Path | None]


class BackgroundSave:
    """The save in flight, its error, and the buffers the thread mode reuses.

    `write` commits a capture into `target` (None: skipped, and reported). A forked writer's
    commit reaches this process through `child_saved(step)`; its skipped save is counted in
    `target`.
    """

    def __init__(self, mode: Literal["auto", "fork", "thread"], write: Write,
                 target: SaveTarget, child_saved: Callable[[int], None]) -> None:
        self.mode = mode
        self._write, self._target, self._child_saved = write, target, child_saved
        self.step: int | None = None  # the step being written; retention leaves it alone
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def start(self, cap: Capture, model: torch.nn.Module | None, shared: bool = False) -> None:
        """Write `cap` in the background; returns once it is snapshotted. `shared`: the state
        lives in shared memory (the memory tier's live state, worker/memtier/live.py), which a
        forked child sees change instead of a copy-on-write view: it is copied (thread)."""
        if cap.world is not None and self.mode == "fork":
            raise ValueError("Saving(async_mode='fork') cannot be used with torch.distributed: a "
                             "forked writer cannot take part in the checkpoint's collectives; "
                             "use async_mode='thread' or 'auto'")
        self.step = cap.step
        if not shared and self._fork_snapshot(cap, model):
            pid, err_fd = fork_writer(self._write, cap)
            target, args = self._wait_child, (cap, pid, err_fd)
        else:
            target, args = self._write_bg, (self._snapshot(cap),)
        self._thread = threading.Thread(target=target, args=args, name="rtrain-ckpt-writer",
                                        daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the save in flight; raise CheckpointError if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.step = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint save failed: {err}") from err

    def _fork_snapshot(self, cap: Capture, model: torch.nn.Module | None) -> bool:
        """Whether to snapshot by fork: the child's copy-on-write view of memory is the
        snapshot, so the training thread is blocked only for the fork (page tables), not for a
        copy of every byte. Only for state that lives in host memory; CUDA state is copied to
        pinned buffers instead (the copy is asynchronous there)."""
        if self.mode == "thread" or not hasattr(os, "fork"):
            return False
        if dist.world() is not None:
            return False  # a forked child cannot join collectives (`start` enforces it)
        return self.mode == "fork" or (not any(
            t.is_pinned() for ts in cap.tensors.values() for t in ts.values()
        ) and not _has_cuda_state(model))

    def _wait_child(self, cap: Capture, pid: int, err_fd: int) -> None:
        try:
            _, status = os.waitpid(pid, 0)
            with os.fdopen(err_fd, "rb") as f:
                message = f.read().decode(errors="replace")
            code = os.waitstatus_to_exitcode(status)
            if code == 0:
                self._child_saved(cap.step)
            elif code == _CHILD_SKIPPED:
                self._target.skipped += 1  # the writer said why, in its log and heartbeat
            else:
                self._error = CheckpointError(message or f"the checkpoint writer process ended "
                                              f"with status {code}")
        finally:
            runtime.heartbeat(step=cap.step, event="save_end")

    def _write_bg(self, cap: Capture) -> None:
        try:
            self._write(cap)
        except BaseException as e:  # surfaced on the next save()/close(), never dropped
            self._error = e
        finally:
            runtime.heartbeat(step=cap.step, event="save_end")

    def _snapshot(self, cap: Capture) -> Capture:
        """Copy tensors into reused CPU buffers so training can go on while they are written."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        pin = torch.cuda.is_available()
        for stem, ts in cap.tensors.items():
            out[stem] = {}
            for name, t in ts.items():
                buf = self._buffers.get((stem, name))
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                    self._buffers[(stem, name)] = buf
                buf.copy_(t, non_blocking=pin)
                out[stem][name] = buf
        if pin:
            torch.cuda.synchronize()
        return replace(cap, tensors=out)


def _has_cuda_state(model: torch.nn.Module | None) -> bool:
    return model is not None and any(p.is_cuda for p in model.parameters())


def fork_writer(write: Write, cap: Capture) -> tuple[int, int]:
    """Fork a process that writes and commits `cap` from its copy-on-write memory; returns its
    pid and the read end of a pipe that carries its error message.

    The child runs only file I/O, hashing and JSON (no torch ops, no imports, no locks another
    thread could hold) and leaves with os._exit, so forking a threaded process is safe here. An
    encrypted checkpoint adds AES on a thread the child starts itself; the Checkpointer
    imported the cipher before any fork.
    """
    import warnings

    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # "process is multi-threaded"
        pid = os.fork()
    if pid:
        os.close(w)
        return pid, r
    code = 0
    try:
        os.close(r)
        if write(cap) is None:
            os.write(w, f"checkpoint at step {cap.step} not saved (storage error or no "
                        "space); earlier checkpoints are intact, training goes on".encode())
            code = _CHILD_SKIPPED
    except BaseException as e:
        os.write(w, f"{type(e).__name__}: {e}".encode(errors="replace"))
        code = 1
    finally:
        os._exit(code)
