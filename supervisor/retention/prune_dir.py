"""Apply the retention policy to a checkpoint directory (used by `rtrain prune` and the worker).

Deleting trades old checkpoints for the ones kept, so the kept ones the deletions depend on
(`retention.Plan.relied`: the newest good one, the newest `keep`, the best `keep_best`) are
verified FULLY before anything is deleted, whatever level listed the directory: a checkpoint with
one flipped byte passes the quick check (sizes), and keeping it in place of the good ones would
leave nothing to resume from. Verification stays cheap: the listing is quick, only the few relied
on are hashed (once; a `VerifiedCache` skips those unchanged since), and when one fails the plan
is made again with it marked bad, until every relied-on checkpoint has passed.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rtrain.checkpoint.commit import remove_dir
from rtrain.checkpoint.layout import TRASH_PREFIX, list_leftovers
from rtrain.checkpoint.verify import Level, Verdict, VerifiedCache, verify, verify_all
from rtrain.supervisor.retention import decide as retention

log = logging.getLogger(__name__)


@dataclass
class Removal:
    path: Path
    reason: str
    bytes: int


@dataclass
class PruneReport:
    removed: list[Removal] = field(default_factory=list)
    kept: list[Verdict] = field(default_factory=list)
    why: dict[Path, str] = field(default_factory=dict)
    """Kept path -> why it is kept (and how it was verified)."""
    failed_full: list[Verdict] = field(default_factory=list)
    """Checkpoints that passed the listing's level but failed full verification."""

    @property
    def freed(self) -> int:
        return sum(r.bytes for r in self.removed)


def dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _metrics(v: Verdict) -> dict:
    # A hand-edited manifest may hold anything here; ranking must not crash on it.
    metrics = (v.manifest or {}).get("metrics")
    return metrics if isinstance(metrics, dict) else {}


def _plan_verified(verdicts: list[Verdict], policy: retention.RetentionPolicy,
                   protect: frozenset[int], key: bytes | None, full_done: bool,
                   cache: VerifiedCache | None, report: PruneReport) -> retention.Plan:
    """Plan, fully verify what the plan relies on, and plan again until all of that passed."""
    by_step = {v.step: v for v in verdicts}
    checked: set[int] = set(by_step) if full_done else set()
    while True:
        cands = [retention.Candidate(v.step, v.ok, _metrics(v), v.path.name)
                 for v in by_step.values()]
        plan = retention.plan(cands, policy, protect)
        todo = [by_step[c.step] for c in plan.relied if c.step not in checked]
        if not todo:
            return plan
        for v in todo:
            checked.add(v.step)
            if cache is not None and cache.holds(v):
                continue
            full = verify(v.path, Level.FULL, key)
            if full.ok:
                if cache is not None:
                    cache.add(full)
                continue
            log.info("%s passed the quick check but fails full verification: %s; "
                     "not relied on", v.path.name, full.describe())
            by_step[v.step] = full
            report.failed_full.append(full)


def prune(ckpt_dir: str | os.PathLike, policy: retention.RetentionPolicy, *,
          level: Level | str = Level.QUICK, key: bytes | None = None, dry_run: bool = False,
          protect: frozenset[int] = frozenset(), leftovers: bool = True,
          verified: VerifiedCache | None = None) -> PruneReport:
    """Remove what the policy does not keep, plus abandoned temp and trash dirs.

    The listing is verified at `level`; what the plan relies on is always verified fully (see the
    module docstring). `verified` carries full verifications over from earlier calls.
    """
    level = Level(level)
    report = PruneReport()
    verdicts = verify_all(ckpt_dir, level, key)
    plan = _plan_verified(verdicts, policy, protect, key, level is Level.FULL, verified, report)
    by_step = {v.step: v for v in verdicts} | {v.step: v for v in report.failed_full}
    report.kept = [by_step[c.step] for c in plan.keep]
    relied = {c.step for c in plan.relied}
    for v in report.kept:
        checked = " (verified full)" if v.step in relied or level is Level.FULL else ""
        status = "" if v.ok else f" ({v.describe()})"
        report.why[v.path] = f"{plan.why.get(v.step, 'kept')}{checked}{status}"
    for cand, reason in plan.delete:
        v = by_step[cand.step]
        path = v.path
        if not v.ok:
            reason = f"{reason} ({v.describe()})"
        size = dir_size(path) if path.is_dir() and not path.is_symlink() else 0
        if not dry_run:
            try:
                remove_dir(path)
            except FileNotFoundError:
                continue  # someone else removed it first
            if verified is not None:
                verified.forget(path)
        report.removed.append(Removal(path, reason, size))
    if leftovers:
        for tmp in list_leftovers(ckpt_dir):
            is_trash = tmp.path.name.startswith(TRASH_PREFIX)
            if not is_trash and tmp.writer_alive():
                continue
            real_dir = tmp.path.is_dir() and not tmp.path.is_symlink()
            size = dir_size(tmp.path) if real_dir else 0
            if not dry_run:
                if real_dir:
                    shutil.rmtree(tmp.path, ignore_errors=True)
                else:
                    tmp.path.unlink(missing_ok=True)  # the entry, never what a link points to
            why = "interrupted deletion" if is_trash else "abandoned temp dir of a save that died"
            report.removed.append(Removal(tmp.path, why, size))
    return report
