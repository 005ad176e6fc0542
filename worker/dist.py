"""The Checkpointer's view of torch.distributed: who we are, and the few collectives a save needs.

Every collective runs on a dedicated gloo group (created on first use, by all ranks at the same
save), never on the training group: the checkpoint's small object broadcasts then work under NCCL
too, and a save running in a background thread cannot interleave with the training loop's own
collectives on the same communicator.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class World:
    rank: int
    size: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


_group: Any = None

PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|"
                       r"NCCL communicator was aborted|remote process exited")
"""What a collective says when a rank of its group went away: gloo's closed or reset
connection, NCCL's aborted communicator."""


def peer_lost(exc: BaseException) -> bool:
    """`exc` is a collective broken by a rank that went away: this rank fails because its group
    broke elsewhere, at about the moment it raised (the supervisor counts a relaunch's
    rendezvous last call from there)."""
    return PEER_LOST.search(str(exc)) is not None


def world() -> World | None:
    """This process's place in an initialised process group; None when there is none."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    return World(torch.distributed.get_rank(), torch.distributed.get_world_size())


def group() -> Any:
    """The checkpoint group (gloo). The first call is itself collective: all ranks make it."""
    global _group
    if _group is None:
        _group = torch.distributed.new_group(backend="gloo")
    return _group


def forget_group() -> None:
    """After `destroy_process_group` (tests that init twice in one process)."""
    global _group
    _group = None


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src, group=group())
    return box[0]


def all_ok(ok: bool) -> bool:
    """True on every rank iff every rank passed True (a MIN all-reduce: also a barrier)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group())
    return bool(flag.item())


def any_of(flags: list[bool]) -> list[bool]:
    """For each flag: True on every rank iff it is True on some rank (a MAX all-reduce)."""
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group())
    return [bool(v) for v in t.tolist()]


def gather(obj: Any) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
    w = world()
    assert w is not None
    out: list[Any] | None = [None] * w.size if w.leader else None
    torch.distributed.gather_object(obj, out, dst=0, group=group())
    return out


def is_sharded(model: torch.nn.Module | None) -> bool:
    """Whether the model's parameters are sharded across ranks (FSDP2 / DTensor, or FSDP1)."""
    if model is None:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDP1) for m in model.modules())
