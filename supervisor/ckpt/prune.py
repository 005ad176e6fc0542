"""Apply the retention policy to a checkpoint directory (used by `rtrain prune` and the worker)."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.ckpt import retention
from supervisor.ckpt.commit import remove_dir
from supervisor.ckpt.layout import TRASH_PREFIX, list_leftovers
from supervisor.ckpt.verify import Level, Verdict, verify_all

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


def prune(
    ckpt_dir: str | os.PathLike,
    policy: retention.RetentionPolicy,
    *,
    level: Level | str = Level.QUICK,
    key: bytes | None = None,
    dry_run: bool = False,
    protect: frozenset[int] = frozenset(),
    leftovers: bool = True,
) -> PruneReport:
    """Remove what the policy does not keep, plus abandoned temp and trash dirs."""
    verdicts = verify_all(ckpt_dir, level, key)
    by_step = {v.step: v for v in verdicts}
    cands = [
        retention.Candidate(v.step, v.ok, (v.manifest or {}).get("metrics") or {}, v.path.name)
        for v in verdicts
    ]
    plan = retention.plan(cands, policy, protect)
    report = PruneReport(kept=[by_step[c.step] for c in plan.keep])
    for cand, reason in plan.delete:
        path = by_step[cand.step].path
        if not by_step[cand.step].ok:
            reason = f"{reason} ({by_step[cand.step].describe()})"
        size = dir_size(path)
        if not dry_run:
            try:
                remove_dir(path)
            except FileNotFoundError:
                continue  # someone else removed it first
        report.removed.append(Removal(path, reason, size))
    if leftovers:
        for tmp in list_leftovers(ckpt_dir):
            is_trash = tmp.path.name.startswith(TRASH_PREFIX)
            if not is_trash and tmp.writer_alive():
                continue
            size = dir_size(tmp.path)
            if not dry_run:
                shutil.rmtree(tmp.path, ignore_errors=True)
            why = "interrupted deletion" if is_trash else "abandoned temp dir of a save that died"
            report.removed.append(Removal(tmp.path, why, size))
    return report
