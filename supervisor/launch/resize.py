"""Whether an attempt's group is smaller or larger than the one that wrote its checkpoint.

Each node's supervisor hears only its own ranks, but every heartbeat under torchrun carries the
group's size (`world`). A group that formed without a lost node (`--nnodes MIN:MAX`, the
rendezvous closed at MIN after its last-call wait) or with more nodes than before is reported
once per attempt, against the `world_size` in the resumed checkpoint's manifest.
"""

from __future__ import annotations

from typing import Any


def saved_world_size(manifest: dict[str, Any] | None) -> int | None:
    """The world size a checkpoint was written with (its manifest's `info`), if recorded."""
    info = (manifest or {}).get("info")
    size = info.get("world_size") if isinstance(info, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def changed(saved: int | None, heard: int | None) -> bool:
    """A group of `heard` ranks resuming a checkpoint written by `saved`: a size worth saying."""
    return saved is not None and heard is not None and heard > 0 and heard != saved


class WorldWatch:
    """Per attempt: the first heartbeat with a group size decides, once."""

    def __init__(self, saved: int | None) -> None:
        self.saved = saved
        self.decided = saved is None  # nothing to compare with: never reports

    def heard(self, world: int | None) -> int | None:
        """The new group size, the first time a heartbeat shows one that differs; else None."""
        if self.decided or world is None:
            return None
        self.decided = True
        return world if changed(self.saved, world) else None
