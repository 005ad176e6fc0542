"""What one save writes (`Capture`) and where it goes (`SaveTarget`): the contract between the
Checkpointer and the code that writes checkpoints, in this process (`write_local`) or across
ranks (`rtrain.worker.saving.dist_ckpt`).

A save that meets a storage error (no space, EIO, a read-only or over-quota filesystem) is
skipped: counted, reported once to the supervisor (`save_skipped`), and training goes on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import crypt, hashing
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.worker import dist, runtime
from rtrain.worker.compilecache import compile_cache
from rtrain.worker.guards import faults
from rtrain.worker.trainstate.tensors import to_blob

log = logging.getLogger(__name__)

FILES = ("model", "optimizer", "extra")


def storage_error(e: BaseException | None) -> bool:
    """An error of the storage, not of the program: the save is skipped, training goes on."""
    return isinstance(e, OSError) and e.errno in STORAGE_ERRNOS


@dataclass
class Capture:
    """Everything one save writes, taken at a step boundary."""

    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> name -> CPU contiguous tensor
    state_json: dict[str, Any]
    fields: dict[str, Any]
    world: dist.World | None = None  # set when a process group is initialised
    rank_rng: dict[str, Any] | None = None  # this rank's python/numpy RNG (rng-rank<R> file)
    sharded: dict[str, Any] | None = None  # state written with torch.distributed.checkpoint
    compile_cache: bytes | None = None  # torch's compile artifacts (worker/compilecache/)

    @property
    def nbytes(self) -> int:
        return (sum(t.numel() * t.element_size() for f in self.tensors.values()
                    for t in f.values()) + len(self.compile_cache or b""))


@dataclass
class SaveTarget:
    """The checkpoint dir and how to commit into it: all a writer needs of the Checkpointer."""

    ckpt_dir: Path
    fsync: bool
    key: bytes | None  # signing key; also picks the file hash
    make_room: Callable[[int], str | None]
    """None when that many bytes fit (after pruning if needed); else why the save is skipped."""
    encryption: crypt.EncryptionKey | None = None
    """Every file of a checkpoint is written encrypted with it
    (checkpoint/encrypted_file.py)."""
    skipped: int = 0
    """Saves skipped so far (`Checkpointer.skipped_saves`)."""

    def skip(self, step: int, reason: str) -> None:
        """A checkpoint that was not written: count it, say why, and tell the supervisor (it
        records a `save_skipped` event, and warns when the run ends unsaved)."""
        self.skipped += 1
        log.warning("checkpoint at step %d not saved (%s); skipping this checkpoint, earlier "
                    "checkpoints are intact, training goes on", step, reason)
        runtime.heartbeat(step=step, event="save_skipped", reason=reason)


def write_local(target: SaveTarget, cap: Capture) -> Path | None:
    """Write and commit `cap` (one process). Returns the committed path, or None when a
    storage error skipped the save; nothing is left behind either way."""
    pending = None
    try:
        pending = PendingCheckpoint(target.ckpt_dir, cap.step, fsync=target.fsync,
                                    hash_alg=hashing.alg_for(target.key),
                                    encryption=target.encryption)
        for stem in FILES:
            blobs = [to_blob(n, t) for n, t in cap.tensors[stem].items()]
            pending.write_tensors(f"{stem}.safetensors", blobs)
            faults.on_save_write(cap.step)
        pending.write_bytes("state.json", json.dumps(cap.state_json).encode())
        if cap.compile_cache is not None:
            pending.write_bytes(compile_cache.FILE, cap.compile_cache)
        return pending.commit(cap.fields, target.key)
    except OSError as e:
        if pending is not None:
            pending.abort()
        if e.errno not in STORAGE_ERRNOS:
            raise
        target.skip(cap.step, os.strerror(e.errno))
        return None
    except BaseException:
        if pending is not None:
            pending.abort()
        raise
