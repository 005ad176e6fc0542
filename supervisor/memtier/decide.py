"""What to do with the memory tier's snapshot when an attempt ends or starts, and with the
worker's requests to persist one as its disk save: pure.

A snapshot (worker/memtier/memory_tier.py) is the newest verified state once the training process is
gone, so rtrain commits it to the checkpoint dir before anything reads that dir (the policy's
progress rule, the next pick, the mirror); the relaunch then resumes from the snapshot itself
when it is the checkpoint the pick chose (same step), reading shared memory instead of disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rtrain.supervisor.retention.decide import RetentionPolicy


def worth_persisting(snapshot_step: int | None, disk_newest: int | None, *,
                     same_run: bool) -> bool:
    """Commit the snapshot? Only this run's (the directory is the checkpoint dir's, but a run
    that started over there has a new identity), and only one newer than every checkpoint on
    disk (an older one would add nothing; one of the same step is already there)."""
    if snapshot_step is None or not same_run:
        return False
    return disk_newest is None or snapshot_step > disk_newest


def resume_from_memory(snapshot_step: int | None, chosen_step: int | None, *,
                       same_files: bool) -> bool:
    """Resume from the snapshot instead of the chosen disk checkpoint: when it is that very
    checkpoint (same step, the same files by their hashes: the disk copy was made from it and
    the pick verified that copy)."""
    return (snapshot_step is not None and snapshot_step == chosen_step and same_files)


# The disk cadence under the memory tier: the worker's scheduled disk saves are snapshots it
# asks rtrain to persist (a `persist` heartbeat), one copy at a time, in rtrain's background.


@dataclass(frozen=True)
class Request:
    """Persist the newest snapshot at `step` or later (a `persist` heartbeat: a request, never
    a policy), then prune with the Keep policy that snapshot's manifest records."""

    step: int


@dataclass(frozen=True)
class Queue:
    """The persist running (its request's step) and the one request remembered meanwhile."""

    running: int | None = None
    pending: Request | None = None


def requested(q: Queue, new: Request) -> tuple[Queue, Request | None]:
    """A `persist` heartbeat arrived: the queue after it, and the request to start now (None:
    it waits, or what runs or waits already covers it). One copy runs at a time; a request
    at or below the running one's step is covered by it (it copies the newest snapshot at its
    step or later); a newer one replaces whatever was waiting (older requests are dropped:
    their snapshots are gone from memory once a newer one commits)."""
    if q.running is None:
        return Queue(running=new.step), new
    if new.step <= q.running or (q.pending is not None and new.step <= q.pending.step):
        return q, None
    return Queue(q.running, new), None


def finished(q: Queue, committed: int | None) -> tuple[Queue, Request | None]:
    """The running persist ended, having committed the snapshot of `committed` (None: none):
    the waiting request to start next, unless that commit covers it."""
    p = q.pending
    if p is None or (committed is not None and p.step <= committed):
        return Queue(), None
    return Queue(running=p.step), p


def snapshot_policy(manifest: Any) -> RetentionPolicy | None:
    """The Keep policy a snapshot's manifest records (the Checkpointer's, signed with the
    manifest when the run signs); None when it records none that reads."""
    info = manifest.get("info") if isinstance(manifest, dict) else None
    return policy_of(info.get("keep")) if isinstance(info, dict) else None


def policy_of(fields: Any) -> RetentionPolicy | None:
    """The worker's Keep policy as a snapshot's manifest records it (`info.keep`:
    RetentionPolicy's fields); None when it does not read as one (nothing is pruned then:
    deleting on a misread rule loses work)."""
    if not isinstance(fields, dict):
        return None
    names = RetentionPolicy.__dataclass_fields__
    try:
        return RetentionPolicy(**{k: v for k, v in fields.items() if k in names})
    except (TypeError, ValueError):
        return None


# Peer copies under several nodes (supervisor/memtier/peerside.py): what to copy from a peer.

KEEP_HELD_STEPS = 2
"""Complete held steps kept (the newest two): the nodes' newest steps may differ by one while
a copy runs, and the group resumes from a step every node holds whole."""


def next_copy(source: list[tuple[int, int]], held: set[tuple[int, int]],
              own: set[int] | None = None) -> tuple[int, list[int]] | None:
    """The step to copy from the source node (its own parts: (rank, step)) and the ranks of it
    this node does not hold yet; None when it holds them all or the source has none. The
    source's newest step that this node also has its own parts of (`own`; any step when it
    has none): the copy and this node's own parts then make one step, since the worker keeps
    its two newest and the source may be a step ahead. Only the newest such step: an older one
    is superseded before it could help."""
    steps = {s for _, s in source}
    shared = steps & own if own else steps
    if not shared:
        return None
    step = max(shared)
    missing = sorted(r for r, s in source if s == step and (r, step) not in held)
    return (step, missing) if missing else None


def held_to_drop(steps: set[int], complete: set[int], keep: int = KEEP_HELD_STEPS
                 ) -> list[int]:
    """Held steps to remove: all but the newest `keep` complete ones (every part copied and
    this node's own kept) and the newest step (a copy that may complete yet)."""
    kept = set(sorted(steps & complete, reverse=True)[:keep])
    if steps:
        kept.add(max(steps))
    return sorted(steps - kept, reverse=True)


def gather_plan(local: set[tuple[int, int, int]], remote: dict[str, set[tuple[int, int, int]]]
                ) -> list[tuple[int, int, dict[int, list[str]]]]:
    """At an attempt's start: the steps whole across this node and the peers (parts as
    (rank, step, world size)) newer than any step whole here already, newest first, each with
    the peers that offer each rank this node lacks of it. Empty: nothing to copy."""
    def whole(parts: set[tuple[int, int, int]]) -> list[tuple[int, int]]:
        have: dict[tuple[int, int], set[int]] = {}
        for r, s, w in parts:
            have.setdefault((s, w), set()).add(r)
        return sorted((k for k, rs in have.items() if len(rs) == k[1] and max(rs) < k[1]),
                      reverse=True)

    here = whole(local)
    union = set(local).union(*remote.values()) if remote else set(local)
    return [(step, size, {r: [n for n in sorted(remote) if (r, step, size) in remote[n]]
                          for r in range(size) if (r, step, size) not in local})
            for step, size in whole(union) if not here or step > here[0][0]]
