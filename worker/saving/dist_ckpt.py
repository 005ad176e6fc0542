"""Checkpoints written by several ranks, under the one commit protocol (contract 3).

    rank 0: make the temp dir ──broadcast name──▶ every rank writes its part into it
    every rank: all_ok(wrote my part)  (MIN all-reduce: also the barrier)
    every rank: its files' sizes and hashes ──gather──▶ rank 0
    rank 0: list every file (hash any nobody reported), manifest, rename ──broadcast──▶ all

Layout inside one checkpoint-<step>/ (docs/architecture.md, "Contract 3: checkpoints on disk"):

    manifest.json, state.json        rank 0 (replicated: step, sampler, scheduler, optimizer meta)
    model/optimizer/extra.safetensors rank 0 (replicated state; empty when the model is sharded)
    rng-rank<R>.safetensors          rank R (its torch/CUDA RNG; python/numpy RNG in metadata)
    dcp/.metadata, dcp/__<R>_<n>.distcp  sharded state, torch.distributed.checkpoint (DCP)

A rank that fails or dies before the all-reduce leaves the temp dir uncommitted: rank 0 commits
only when every rank said it wrote its part.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint.commit import PendingCheckpoint, fsync_dir
from rtrain.checkpoint.hashing import alg_for
from rtrain.checkpoint.layout import MANIFEST
from rtrain.checkpoint.verified_read import LoadError
from rtrain.supervisor.core.errors import CheckpointError, CorruptCheckpoint, StateMismatch
from rtrain.worker import dist
from rtrain.worker.guards import faults
from rtrain.worker.saving.save_target import Capture, SaveTarget, storage_error
from rtrain.worker.trainstate.tensors import load_listed, to_blob

log = logging.getLogger(__name__)

DCP_DIR = "dcp"


def rng_stem(rank: int) -> str:
    return f"rng-rank{rank}"


# ---------------------------------------------------------------- save


def sharded_state(model: torch.nn.Module | None, optimizer: Any) -> dict[str, Any]:
    """The state DCP writes: FQN-keyed model (and optimizer) state, DTensors left sharded."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if model is None:
        raise ValueError("sharded checkpoints need the model (pass model=...)")
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def write(target: SaveTarget, cap: Capture) -> Path | None:
    """Write this rank's part of `cap`; rank 0 commits. Collective: every rank calls it at the
    same step. Returns the committed path, or None when the save was skipped (no space, a
    storage error on some rank)."""
    w = cap.world
    assert w is not None
    pending, why = None, "rank 0 could not start the checkpoint"
    if w.leader:
        pending, why = _start(target, cap, w)
    name = dist.broadcast(None if pending is None else pending.tmp.name)
    if name is None:
        _skipped(target, w, cap.step, why)
        return None
    if pending is None:
        pending = PendingCheckpoint.adopt(target.ckpt_dir, cap.step, target.ckpt_dir / name,
                                          fsync=target.fsync, hash_alg=alg_for(target.key),
                                          encryption=target.encryption)
    error: BaseException | None = None
    try:
        _write_part(pending, cap, target.fsync)
    except BaseException as e:  # every rank learns of it below; re-raised there
        error = e
    try:
        ok = dist.all_ok(error is None)
    except BaseException:
        # A rank died mid-save: the collective fails, and nothing commits.
        if w.leader:
            pending.abort()
        raise
    if not ok:
        if w.leader:
            pending.abort()
        if error is not None and not storage_error(error):
            raise error
        _skipped(target, w, cap.step, os.strerror(error.errno) if isinstance(error, OSError)
                 else "another rank could not write its part")
        return None
    # Each rank's generation token too: the nodes' supervisors each advanced the shared dir's
    # generation, and the commit is the group's while the current token is any of them.
    parts = dist.gather((pending.files, pending.tensors, pending.generation))
    committed = None
    if w.leader:
        assert parts is not None
        try:
            committed = _commit(target, pending, cap, parts)
        except OSError as e:
            pending.abort()
            if not storage_error(e):
                raise
            why = os.strerror(e.errno)
    committed = dist.broadcast(committed)  # no rank goes on before the commit
    if committed is None:
        _skipped(target, w, cap.step, why)
        return None
    return target.ckpt_dir / committed


def _start(target: SaveTarget, cap: Capture, w: dist.World
           ) -> tuple[PendingCheckpoint | None, str]:
    """Rank 0: make room and the temp dir every rank writes into; or say why not."""
    try:
        short = target.make_room(cap.nbytes * (w.size if cap.sharded is not None else 1))
        if short is not None:
            return None, short
        return PendingCheckpoint(target.ckpt_dir, cap.step, fsync=target.fsync,
                                 hash_alg=alg_for(target.key),
                                 encryption=target.encryption), ""
    except OSError as e:
        if not storage_error(e):
            raise
        return None, os.strerror(e.errno)


def _skipped(target: SaveTarget, w: dist.World, step: int, why: str) -> None:
    """Every rank counts the skipped save; rank 0 alone reports it (one event per save)."""
    if w.leader:
        target.skip(step, why)
    else:
        target.skipped += 1


def _write_part(pending: PendingCheckpoint, cap: Capture, fsync: bool) -> None:
    w = cap.world
    assert w is not None
    for stem, ts in cap.tensors.items():
        meta = {"rng": json.dumps(cap.rank_rng)} if stem == rng_stem(w.rank) else None
        pending.write_tensors(f"{stem}.safetensors", [to_blob(n, t) for n, t in ts.items()],
                              metadata=meta)
        faults.on_save_write(cap.step)
    if w.leader:
        pending.write_bytes("state.json", json.dumps(cap.state_json).encode())
    if cap.sharded is None:
        return
    import torch.distributed.checkpoint as dcp

    out = pending.tmp / DCP_DIR
    dcp.save(cap.sharded, storage_writer=dcp.FileSystemWriter(out, sync_files=fsync),
             process_group=dist.group())
    faults.on_save_write(cap.step)
    # Each rank hashes (and, for an encrypted checkpoint, encrypts) its own shards, in
    # parallel; rank 0 also the global .metadata.
    mine = sorted(out.glob(f"__{w.rank}_*.distcp"))
    if w.leader:
        mine += [out / ".metadata"]
    for f in mine:
        pending.add_file(f"{DCP_DIR}/{f.name}", *pending.seal_file(f"{DCP_DIR}/{f.name}"))


def _commit(target: SaveTarget, pending: PendingCheckpoint, cap: Capture,
            parts: list[Any]) -> str:
    for files, tensors, _ in parts[1:]:
        for n, entry in files.items():
            pending.add_file(n, entry["size"], entry["hash"], tensors.get(n))
    pending.generation = [token for _, _, token in parts if token]
    # The manifest covers every file in the temp dir, whoever wrote it.
    for root, _, names in os.walk(pending.tmp):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), pending.tmp)
            if rel != MANIFEST and rel not in pending.files:
                pending.add_file(rel, *pending.seal_file(rel))
    if target.fsync and (pending.tmp / DCP_DIR).is_dir():
        fsync_dir(pending.tmp / DCP_DIR)
    return pending.commit(cap.fields, target.key).name


# ---------------------------------------------------------------- restore


def agree(pick: Callable[[], Any], w: dist.World) -> tuple[Path, dict[str, Any]] | None:
    """Rank 0 picks and verifies a checkpoint; every rank gets (path, manifest) or None."""
    payload: tuple[str, Any] = ("ok", None)
    error: BaseException | None = None
    if w.leader:
        try:
            v = pick()
            payload = ("ok", None if v is None else (str(v.path), v.manifest))
        except Exception as e:  # every rank must hear of it, or the others wait forever
            error, payload = e, ("error", str(e))
    kind, value = dist.broadcast(payload)
    if error is not None:
        raise error
    if kind == "error":
        raise CheckpointError(f"rank 0 could not pick a checkpoint: {value}")
    return None if value is None else (Path(value[0]), value[1])


def check_world(info: dict[str, Any], w: dist.World | None, sharded_now: bool,
                allow_resize: bool, name: str) -> str:
    """The layout to load ("sharded" or "replicated"), or StateMismatch naming both sizes, or
    CorruptCheckpoint for a sharded checkpoint without a process group to load it into."""
    saved_size = int(info.get("world_size", 1))
    saved_layout = info.get("layout", "single")
    size = w.size if w is not None else 1
    if saved_layout == "sharded":
        if w is None:
            # Sharded state loads only through DCP under a process group; a single process
            # handed one is looking at a checkpoint that does not belong to this run.
            raise CorruptCheckpoint(name, "cannot load here: it holds sharded (DCP) state, "
                                    "which loads only under torch.distributed (torchrun); "
                                    "this process has no process group")
        return "sharded"  # DCP reshards onto any world size
    if sharded_now:
        raise StateMismatch(
            f"{name} holds unsharded state saved by world size {saved_size}, but this run "
            f"shards its model (FSDP/DTensor) over world size {size}: sharded models resume only "
            "from sharded (DCP) checkpoints; resume it unsharded and save once to convert")
    if saved_size != size and not allow_resize:
        raise StateMismatch(
            f"{name} was saved by world size {saved_size}, this run has world size {size}: a "
            "replicated checkpoint holds one RNG state per rank and resumes exactly only at the "
            f"same size; run {saved_size} processes, or pass Restoring(allow_resize=True) to "
            "load the model and optimizer anyway (not bitwise exact)")
    return "replicated"


def load_rank_rng(path: Path, m: dict[str, Any], st: dict[str, Any],
                  extra: dict[str, torch.Tensor], rank: int, alg: str, enc: Any = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """This rank's RNG state: its rng-rank<R> file, else (rank 0) the single-process one."""
    name = f"{rng_stem(rank)}.safetensors"
    if name in m["files"]:
        tensors, meta = load_listed(path, name, m, alg, enc)
        try:
            plain = json.loads(meta["rng"])
        except (KeyError, ValueError, RecursionError):
            raise LoadError(f"{name} holds no readable RNG metadata") from None
        return tensors, plain
    if "rng" in st and "rng/torch_cpu" in extra and rank == 0:
        return extra, st["rng"]
    log.warning("%s holds no RNG state for rank %d: this rank keeps its own, so the resume is "
                "not bitwise exact", path.name, rank)
    return None


def load_sharded(path: Path, m: dict[str, Any], alg: str, model: torch.nn.Module | None,
                 optimizer: Any, allow_pickle: bool = False, enc: Any = None) -> None:
    """Load DCP state into the model (and optimizer), resharding onto this world.

    DCP's own reader unpickles `.metadata` and its planner unpickles non-tensor items, so a
    checkpoint could run code; here both go through `dcp_safe` (allow-listed classes only,
    `weights_only` loading, every file read once and checked against the manifest's hash).
    `allow_pickle=True` hands the files to DCP's stock reader instead (trusted checkpoints
    only, e.g. one whose metadata uses classes the allow-list does not know).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from rtrain.worker.trainstate import dcp_safe

    sd = sharded_state(model, optimizer)
    group = dist.group() if dist.world() is not None else None
    if allow_pickle and m.get("encryption") is not None:
        raise LoadError("allow_pickle=True hands the files to DCP's own reader, which cannot "
                        "read encrypted files: load encrypted sharded checkpoints without it")
    if allow_pickle:
        log.warning("allow_pickle=True: loading %s with torch's DCP reader, which UNPICKLES "
                    "its files: only do this for checkpoints you trust, it runs any code "
                    "they contain", path.name)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path / DCP_DIR), process_group=group)
    else:
        dcp_safe.load(sd, path, DCP_DIR, m, alg, group, enc)
    assert model is not None
    if optimizer is None:
        set_model_state_dict(model, sd["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
