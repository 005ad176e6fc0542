"""What to do with the memory tier's snapshot when an attempt ends or starts: pure.

A snapshot (worker/memory_tier.py) is the newest verified state once the training process is
gone, so rtrain commits it to the checkpoint dir before anything reads that dir (the policy's
progress rule, the next pick, the mirror); the relaunch then resumes from the snapshot itself
when it is the checkpoint the pick chose (same step), reading shared memory instead of disk.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Persist:
    """Commit the snapshot of `step` to the checkpoint dir (`why` goes into the event)."""

    step: int
    why: str


def persist(snapshot_step: int | None, disk_newest: int | None, *, same_run: bool,
            why: str) -> Persist | None:
    """The snapshot to commit: only this run's (the directory is the checkpoint dir's, but a
    run that started over there has a new identity), and only one newer than every checkpoint
    on disk (an older one would add nothing; one of the same step is already there)."""
    if snapshot_step is None or not same_run:
        return None
    if disk_newest is not None and snapshot_step <= disk_newest:
        return None
    return Persist(snapshot_step, why)


def resume_from_memory(snapshot_step: int | None, chosen_step: int | None, *,
                       same_files: bool) -> bool:
    """Resume from the snapshot instead of the chosen disk checkpoint: when it is that very
    checkpoint (same step, the same files by their hashes: the disk copy was made from it and
    the pick verified that copy)."""
    return (snapshot_step is not None and snapshot_step == chosen_step and same_files)
