"""A process group resuming from the memory tier: one step, whole on every node, or the disk.

Under torchrun each rank's snapshot is a part of the step (checkpoint/parts.py); the
node's memory dir holds its own ranks' parts and the parts rtrain copied from a peer node
(supervisor/memtier/peerside.py), so the ranks of a node need not be the ones that wrote them:
a relaunch may place rank 2 on another node, and a replacement node starts with what it pulled
from its peer. Every rank lists the steps whose parts are whole in its node's memory dir (every
rank 0..W-1 of this world size, this run's, the manifest checked); rank 0 takes the newest
step whole on every rank and at least as new as the disk checkpoint rtrain picked, and
broadcasts it (only where rtrain allows it: RTRAIN_MEMORY_RESUME, never on a rollback).
Each rank then reads the replicated state from rank 0's part and its RNG from its own, hashed as
read; unless every rank read its parts, the group resumes from the disk checkpoint instead:
a step is never mixed across ranks, and one bad copy costs a tier, not the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rtrain.checkpoint import parts, runid
from rtrain.checkpoint.layout import parse_step
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, ENV_MEMORY_RESUME, ENV_RESUME_FROM
from rtrain.worker import dist

log = logging.getLogger(__name__)


def memory_dir() -> Path | None:
    where = os.environ.get(ENV_MEMORY_DIR)
    return Path(where) if where else None


def allowed() -> bool:
    """rtrain lets the group resume from memory: not on a rollback, nor from a named path."""
    return memory_dir() is not None and os.environ.get(ENV_MEMORY_RESUME) == "1"


def this_runs_parts(key: bytes | None) -> list[parts.Part]:
    """The parts in this node's memory dir of the run it names (listed once per restore: each
    part's manifest is read and checked)."""
    where = memory_dir()
    if where is None:
        return []
    run = runid.read(where)
    return [p for p in parts.list_parts(where, key) if p.run == run]


def whole(found: list[parts.Part]) -> list[tuple[int, int]]:
    """(step, world size) of every step whole among `found`, newest first."""
    run = found[0].run if found else None
    return parts.whole_steps([(p.rank, p.step, p.world_size, p.run) for p in found], run)


def disk_step() -> int | None:
    """The step of the disk checkpoint rtrain picked for this attempt (None: a fresh start)."""
    chosen = os.environ.get(ENV_RESUME_FROM)
    return parse_step(Path(chosen).name) if chosen else None


def choose(every_rank: list[list[tuple[int, int]]], size: int, disk: int | None) -> int | None:
    """The newest step whole on every rank at this world size, when at least as new as `disk`
    (at the same step the parts hold the state the disk checkpoint holds, and memory is read
    faster): pure."""
    common: set[int] | None = None
    for whole in every_rank:
        steps = {step for step, world in whole if world == size}
        common = steps if common is None else common & steps
    if not common:
        return None
    best = max(common)
    return best if disk is None or best >= disk else None


def agree(w: dist.World, found: list[parts.Part]) -> int | None:
    """Collective: the step the group resumes from memory, or None (the disk tier)."""
    every = dist.gather(whole(found))
    step = choose(every, w.size, disk_step()) if every is not None else None
    return dist.broadcast(step)


def parts_for(found: list[parts.Part], step: int, rank: int) -> tuple[parts.Part, parts.Part]:
    """(rank 0's part: the replicated state, this rank's part: its RNG) at `step`. Raises
    LookupError when this node lacks one (another rank's listing said it was whole)."""
    leader, own = parts.pick(found, step, 0), parts.pick(found, step, rank)
    if leader is None or own is None:
        raise LookupError(f"the memory snapshot of step {step} lacks rank "
                          f"{0 if leader is None else rank}'s part on this node")
    return leader, own
