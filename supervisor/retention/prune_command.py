"""`rtrain prune`: the retention policy of `retention.decide`, applied from the command line."""

from __future__ import annotations

import os
from pathlib import Path

from rtrain.checkpoint.verify import Level
from rtrain.supervisor.core.errors import CheckpointError, UsageError
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.supervisor.retention.prune_dir import PruneReport, dir_size, prune


def policy_from_options(*, keep: int, keep_best: int = 0, metric: str | None = None,
                        mode: str | None = None, milestone_every: int = 0) -> RetentionPolicy:
    """Check the option combination here so the message names options, not fields."""
    if keep < 1:
        raise UsageError(f"--keep must be at least 1 (got {keep}): the newest verified "
                         "checkpoint is always kept")
    if keep_best < 0 or milestone_every < 0:
        raise UsageError("--keep-best and --milestone-every must be 0 or more")
    if keep_best and not metric:
        raise UsageError("--keep-best needs --metric NAME (the metric that ranks checkpoints, "
                         "e.g. --metric loss --mode min)")
    if not keep_best and (metric is not None or mode is not None):
        raise UsageError("--metric and --mode only apply with --keep-best K: add it or drop them")
    try:
        return RetentionPolicy(keep=keep, keep_best=keep_best, metric=metric,
                               mode=mode or "min", milestone_every=milestone_every)
    except ValueError as e:
        raise UsageError(str(e)) from None


def prune_dir(ckpt_dir: str | os.PathLike, *, policy: RetentionPolicy,
              verify: Level = Level.QUICK, key: bytes | None = None,
              dry_run: bool = False) -> PruneReport:
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise UsageError(f"no checkpoint directory at {root}")
    from rtrain.supervisor.commands.inspecting import is_checkpoint_dir

    if is_checkpoint_dir(root):
        raise UsageError(f"{root} is one checkpoint: give the directory that holds them")
    try:
        return prune(root, policy, level=verify, key=key, dry_run=dry_run)
    except OSError as e:
        from rtrain.supervisor.core.untrusted_text import safe

        raise CheckpointError(f"prune stopped: cannot remove {safe(e.filename or root)} "
                              f"({e.strerror or e})") from None


def render_prune(report: PruneReport, *, dry_run: bool) -> str:
    from rtrain.supervisor.commands.inspect_render import human_size, table
    from rtrain.supervisor.core.untrusted_text import safe

    verb = "would remove" if dry_run else "removed"
    rows = [[verb, r.path.name, human_size(r.bytes), r.reason] for r in report.removed]
    # What stays and why: the newest that verifies fully is always among them.
    rows += [["would keep" if dry_run else "kept", v.path.name,
              human_size(dir_size(v.path)) if v.path.is_dir() and not v.path.is_symlink()
              else "-", report.why.get(v.path, "")] for v in report.kept]
    lines = [] if report.removed else ["nothing to remove"]
    lines += table(rows, "") if rows else []
    kept = ", ".join(safe(v.path.name) for v in report.kept) or "none"
    lines.append(f"{'would free' if dry_run else 'freed'} {human_size(report.freed)}; "
                 f"kept {len(report.kept)} checkpoint{'s' if len(report.kept) != 1 else ''}: "
                 f"{kept}")
    return "\n".join(lines)
