"""Retention inside the training process: prune after each save, and make room before one.

After a save, checkpoints the policy does not keep are removed (`apply`); the one being written
in the background is never touched. Before a save that would not fit, the policy is tightened
by one (never below the newest) to make room (`make_room`); if it still does not fit, the save
is skipped with the reason. Checkpoints this process wrote and hashed count as fully verified
(`remember`), so pruning re-reads only what it did not write or what changed since.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from rtrain.checkpoint.commit import free_bytes
from rtrain.checkpoint.verify import Level, VerifiedCache, verify
from rtrain.supervisor.core import filemode
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.supervisor.retention.prune_dir import PruneReport, prune

log = logging.getLogger(__name__)

_HEADROOM = 1 << 20  # bytes beyond the tensors: manifest, state.json, safetensors headers


class Retention:
    """`policy` applied to the checkpoints in `ckpt_dir`, from inside the training process."""

    def __init__(self, ckpt_dir: Path, policy: RetentionPolicy, key: bytes | None) -> None:
        self.ckpt_dir, self.policy, self.key = ckpt_dir, policy, key
        self._verified = VerifiedCache()  # checkpoints retention may rely on without re-hashing

    def remember(self, path: Path) -> None:
        """`path` was just written and hashed by this process: count it as fully verified."""
        self._verified.add(verify(path, Level.QUICK, self.key))

    def apply(self, last_saved: Path | None, protect: frozenset[int] = frozenset()) -> None:
        """Prune what the policy does not keep; the steps in `protect` stay whatever it says."""
        if last_saved is not None:
            # Hashed from the very bytes it wrote a moment ago: counts as fully verified, so
            # retention re-reads only checkpoints this process did not write (or that changed).
            self.remember(last_saved)
        report = prune(self.ckpt_dir, self.policy, key=self.key, protect=protect,
                       verified=self._verified)
        _log_report(report, "retention: ", logging.INFO)

    def make_room(self, nbytes: int) -> str | None:
        """None when `nbytes` fit (after pruning if needed); else why the save must be skipped."""
        try:
            filemode.make_dir(self.ckpt_dir, filemode.from_env())
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS and not isinstance(e, PermissionError):
                raise
            return f"cannot create {self.ckpt_dir}: {e.strerror}"
        need = nbytes + _HEADROOM
        if free_bytes(self.ckpt_dir) >= need:
            return None
        # Make room for the new one: keep one fewer than the policy says (never the newest).
        keep = None if self.policy.keep is None else max(1, self.policy.keep - 1)
        report = prune(self.ckpt_dir, replace(self.policy, keep=keep), key=self.key,
                       verified=self._verified)
        _log_report(report, "low on disk: ", logging.WARNING)
        free = free_bytes(self.ckpt_dir)
        if free >= need:
            return None
        return (f"no room: it needs about {need / 2**20:.1f} MiB and {self.ckpt_dir} has "
                f"{free / 2**20:.1f} MiB free; free some space or lower keep")


def _log_report(report: PruneReport, prefix: str, removal_level: int) -> None:
    for v in report.failed_full:
        log.warning("%s%s passes the quick check but fails full verification (%s): not "
                    "counted as a good checkpoint", prefix, v.path.name, v.describe())
    for r in report.removed:
        log.log(removal_level, "%sremoved %s (%s)", prefix, r.path.name, r.reason)
    log.info("%skept %s", prefix, "; ".join(f"{v.path.name}: {report.why.get(v.path, '')}"
                                            for v in report.kept) or "none")
