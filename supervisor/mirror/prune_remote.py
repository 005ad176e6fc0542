"""Which mirror checkpoints to keep: the local retention policy (`retention.decide.plan`) applied
to a mirror's listing.

A committed remote checkpoint (manifest present) counts as good unless a check found it bad
(`bad`); an unfinished upload counts as failed. So, as locally: the newest `keep_remote`
committed checkpoints and every milestone are kept, the newest committed one is never deleted,
unfinished uploads older than it are deleted, and newer ones (an upload in flight, perhaps from
another machine) are left alone, as is every step in `protect` (the one being uploaded).

`prune_remote` checks the committed checkpoints the deletions rely on (`Plan.relied`) before
deleting anything and plans again without those that fail, as `retention.prune_dir` does locally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rtrain.checkpoint.verify import Level, Verdict
from rtrain.supervisor.mirror.store import Mirror, RemoteCheckpoint, checkpoints
from rtrain.supervisor.retention import decide as retention

UNFINISHED = "an unfinished upload older than the newest committed checkpoint"
KEPT_UNFINISHED = ("an unfinished upload newer than every committed checkpoint (perhaps still "
                   "in flight): left alone")


def _plan(remote: list[RemoteCheckpoint], keep_remote: int, milestone_every: int,
          protect: Iterable[int], bad: frozenset[int]) -> retention.Plan:
    policy = retention.RetentionPolicy(keep=keep_remote, milestone_every=milestone_every)
    cands = [retention.Candidate(r.step, r.committed and r.step not in bad, {}, r.name)
             for r in remote]
    return retention.plan(cands, policy, frozenset(protect))


def plan_remote(remote: list[RemoteCheckpoint], keep_remote: int, milestone_every: int = 0,
                protect: Iterable[int] = frozenset(), bad: frozenset[int] = frozenset(),
                ) -> tuple[list[RemoteCheckpoint], list[tuple[RemoteCheckpoint, str]]]:
    """(kept, [(deleted, why)]), newest first. Pure. `bad`: committed steps a check refused.
    Raises ValueError for a `keep_remote` below 1 (the newest committed one is always kept)."""
    by_step = {r.step: r for r in remote}
    plan = _plan(remote, keep_remote, milestone_every, protect, bad)
    return ([by_step[c.step] for c in plan.keep],
            [(by_step[c.step], _reason(by_step[c.step], why, bad)) for c, why in plan.delete])


def _reason(r: RemoteCheckpoint, why: str, bad: frozenset[int]) -> str:
    if not r.committed:
        return UNFINISHED
    if r.step in bad:
        return "fails verification and a newer committed checkpoint verifies"
    return why


@dataclass
class RemotePrune:
    kept: list[RemoteCheckpoint] = field(default_factory=list)
    deleted: list[tuple[RemoteCheckpoint, str]] = field(default_factory=list)
    why: dict[int, str] = field(default_factory=dict)
    """Step -> why it is kept."""
    failed: list[Verdict] = field(default_factory=list)
    """Committed checkpoints relied on that failed their check (not relied on after all)."""
    bytes: int = 0
    """What the deletions free (from the listing)."""


def prune_remote(mirror: Mirror, *, keep_remote: int, milestone_every: int = 0,
                 protect: Iterable[int] = frozenset(), dry_run: bool = False,
                 level: Level | str = Level.QUICK, key: bytes | None = None,
                 check: Callable[[RemoteCheckpoint, dict[str, int]], Verdict] | None = None,
                 mine: Callable[[RemoteCheckpoint], bool] | None = None,
                 ) -> RemotePrune:
    """Apply `plan_remote` to the mirror. The checkpoints relied on are verified at `level`
    first (`check` replaces `mirror.verify_remote.verify_remote`, e.g. in tests); deletions remove
    manifest.json first (`Mirror.delete`). `mine`: only the checkpoints it accepts are
    planned for (the uploader's: this run's; another run's under the same URL are never
    counted, kept or deleted by it); None: all."""
    if check is None:
        from rtrain.supervisor.mirror.verify_remote import verify_remote

        def check(rc: RemoteCheckpoint, sizes: dict[str, int]) -> Verdict:
            return verify_remote(mirror, rc, level, key, sizes)

    protect = frozenset(protect)
    inventory = mirror.inventory()
    remote = [r for r in checkpoints(inventory) if mine is None or mine(r)]
    by_step = {r.step: r for r in remote}
    unfinished = {r.step for r in remote if not r.committed and r.step not in protect}
    out = RemotePrune()
    bad: set[int] = set()
    checked: set[int] = set()
    while True:
        plan = _plan(remote, keep_remote, milestone_every, protect, frozenset(bad))
        todo = [c.step for c in plan.relied if c.step not in checked]
        if not todo:
            break
        for step in todo:
            checked.add(step)
            v = check(by_step[step], inventory[by_step[step].name])
            if not v.ok:
                bad.add(step)
                out.failed.append(v)
    kept, deleted = plan_remote(remote, keep_remote, milestone_every, protect, frozenset(bad))
    out.kept, out.deleted = kept, deleted
    out.why = {step: (KEPT_UNFINISHED if step in unfinished else why)
               for step, why in plan.why.items()}
    for r, _ in deleted:
        out.bytes += sum(inventory[r.name].values())
        if not dry_run:
            mirror.delete(r.name)
    return out
