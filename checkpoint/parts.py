"""The memory tier under torchrun: each rank's snapshot ("part") and which parts make a whole
step of the group.

Under a process group every rank snapshots its own part of the step into the node's memory dir
(worker/memtier/memory_tier.py): rank 0 the replicated state (model, optimizer, extras, state.json)
and its RNG, every other rank its RNG (`rng-rank<R>.safetensors`). Each part is a checkpoint of
its own (manifest, hashes, signature, run identity), committed by rename:

    <memory dir>/rank-<R>/checkpoint-<S>/        written by this node's rank R
    <memory dir>/held/rank-<R>/checkpoint-<S>/   copied from a peer node, or this node's own
                                                 part kept (a hard link) beside the peer's copy
                                                 of the same step (supervisor/memtier/peerside.py)

A step is restored from memory only when every rank 0..W-1 of one world size has a part of it
(`whole_steps`): the group never mixes steps across ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import runid
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify

HELD = "held"
OWN, KEPT = "own", "held"  # a part's origin: written here, or held (copied or kept)
RANK_DIR = re.compile(r"rank-(0|[1-9][0-9]{0,5})")


@dataclass(frozen=True)
class Part:
    rank: int
    step: int
    world_size: int
    run: str | None
    origin: str
    path: Path
    manifest: dict[str, Any]

    @property
    def bytes(self) -> int:
        return sum(int(e.get("size", 0)) for e in self.manifest.get("files", {}).values())


def rank_dir(memory_dir: Path, rank: int, *, held: bool = False) -> Path:
    return (memory_dir / HELD if held else memory_dir) / f"rank-{rank}"


def part_fields(rank: int, world_size: int) -> dict[str, Any]:
    """What a part's manifest `info` says of it (beside `memory_snapshot`)."""
    return {"rank": rank, "world_size": world_size, "layout": "replicated", "part": True}


def list_parts(memory_dir: Path, key: bytes | None, *, origins: Iterable[str] = (OWN, KEPT)
               ) -> list[Part]:
    """Every committed part under `memory_dir` whose manifest checks (quick: signature, file
    names and sizes; the content is hashed when it is copied or loaded) and agrees with the
    directory it lies in. Newest first."""
    out: list[Part] = []
    for origin in origins:
        base = memory_dir / HELD if origin == KEPT else memory_dir
        try:
            names = sorted(p.name for p in base.iterdir() if RANK_DIR.fullmatch(p.name)
                           and p.is_dir() and not p.is_symlink())
        except OSError:
            continue
        for name in names:
            rank = int(name.split("-")[1])
            for step, path in list_checkpoints(base / name):
                v = verify(path, Level.QUICK, key)
                part = _as_part(v.manifest, rank, step, origin, path) if v.ok else None
                if part is not None:
                    out.append(part)
    out.sort(key=lambda p: (-p.step, p.rank, p.origin))
    return out


def _as_part(m: dict[str, Any] | None, rank: int, step: int, origin: str, path: Path
             ) -> Part | None:
    info = (m or {}).get("info")
    if not isinstance(info, dict) or not info.get("part") or info.get("rank") != rank:
        return None
    size = info.get("world_size")
    if not isinstance(size, int) or not 0 <= rank < size:
        return None
    assert m is not None
    return Part(rank, step, size, runid.of(m), origin, path, m)


def whole_steps(parts: Iterable[tuple[int, int, int, str | None]], run: str | None
                ) -> list[tuple[int, int]]:
    """(step, world size) for which ranks 0..W-1 all have a part of `run`, newest first.
    `parts`: (rank, step, world size, run) of each part at hand (any origin)."""
    have: dict[tuple[int, int], set[int]] = {}
    for rank, step, size, owner in parts:
        if owner == run and 0 <= rank < size:
            have.setdefault((step, size), set()).add(rank)
    whole = [k for k, ranks in have.items() if len(ranks) == k[1]]
    return sorted(whole, key=lambda k: (-k[0], k[1]))


def newest_whole(memory_dir: Path, key: bytes | None) -> Part | None:
    """Rank 0's part of the newest step whole in `memory_dir` (what `rtrain status` shows)."""
    found = list_parts(memory_dir, key)
    run = runid.read(memory_dir)
    whole = whole_steps([(p.rank, p.step, p.world_size, p.run) for p in found], run)
    return pick(found, whole[0][0], 0) if whole else None


class NotOneStep(ValueError):
    """Parts that do not make one checkpoint (the message says which field differs)."""


_PART_ONLY = ("part", "rank")  # what a part's info says of itself, not of the step


def group_manifest(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest of the disk checkpoint the parts of one whole step make (pure): rank 0's,
    its `info` without the part's own fields, listing every part's files (each rank's RNG file
    beside rank 0's replicated state, the layout a collective disk save writes). Unsigned: the
    caller signs it. Raises NotOneStep when the parts do not agree on the step, run, hash,
    encryption or world size, a rank is missing or doubled, or two parts list one name."""
    by_rank = {m.get("info", {}).get("rank"): m for m in manifests}
    first = by_rank.get(0)
    if first is None:
        raise NotOneStep("no part of rank 0")
    size = first["info"].get("world_size")
    if sorted(by_rank) != list(range(size)) or len(manifests) != size:
        raise NotOneStep(f"ranks {sorted(map(str, by_rank))} are not 0..{size - 1} once each")
    for key in ("step", "run", "hash_alg", "encryption"):
        if any(m.get(key) != first.get(key) for m in manifests):
            raise NotOneStep(f"the parts differ in {key}")
    if any(m["info"].get("world_size") != size for m in manifests):
        raise NotOneStep("the parts differ in world size")
    out = {k: v for k, v in first.items() if k not in ("signature", "files", "tensors")}
    out["info"] = {k: v for k, v in first["info"].items() if k not in _PART_ONLY}
    out["files"], tensors = {}, {}
    for rank in range(size):
        m = by_rank[rank]
        for name, entry in m["files"].items():
            if name in out["files"]:
                raise NotOneStep(f"{name} is listed by two parts")
            out["files"][name] = entry
        tensors.update(m.get("tensors") or {})
    if "tensors" in first:
        out["tensors"] = tensors
    return out


def pick(parts: Iterable[Part], step: int, rank: int) -> Part | None:
    """The part of `rank` at `step` (its own copy first)."""
    found = [p for p in parts if p.step == step and p.rank == rank]
    found.sort(key=lambda p: p.origin != OWN)
    return found[0] if found else None
