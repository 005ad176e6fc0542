"""An attempt's last state committed to the checkpoint dir while the relaunch already starts.

When an attempt ends, the relaunch resumes from its newest snapshot in memory, which the
worker reads without hashing (worker/restoring/restore.py): rtrain hashed every byte of it,
as it sealed the live state into it (live_seal.py), or in place just before for a snapshot the
worker wrote (`persist.check_content`, through a mapping: ~30 ms for 120 MiB). Its copy to the
checkpoint dir (persist.py: each file hashed as it is copied and checked against the manifest,
then fsynced) runs in this thread meanwhile instead of before the relaunch; for a 120 MiB state
that was 0.06-0.55 s of every recovery.

Until the copy is done the pick and the progress rule count the checkpoint as in the dir
(`Checkpoints.in_flight`, launch/resume.py): nothing can be newer there, since it is committed
only when it is newer than the dir's newest. Whatever commits, prunes or ends the launch waits
for it first (`MemoryTierDir.settle_sync`). A copy that fails leaves the snapshot in memory, as
a failed synchronous copy does, and the loop's thread says so when it next looks: this thread
writes no event.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rtrain.checkpoint.layout import checkpoint_name
from rtrain.checkpoint.verify import Status, Verdict
from rtrain.supervisor.memtier import persist


class BackgroundCommit:
    """One snapshot's copy to the checkpoint dir, running in a thread of its own."""

    def __init__(self, snap: Verdict, ckpt_dir: Path, *, mode: int, why: str,
                 attempt: int) -> None:
        self.snap, self.why, self.attempt = snap, why, attempt  # the attempt that ended
        self.path = ckpt_dir / checkpoint_name(snap.step)
        self.result: persist.Persisted | BaseException | None = None
        self.fsync_error: OSError | None = None  # committed, but not made durable
        self.seconds = 0.0  # the copy's (the fsync after it is durability, not the commit)
        self._thread = threading.Thread(target=self._run, args=(ckpt_dir, mode),
                                        name="rtrain-commit", daemon=True)
        self._thread.start()

    def _run(self, ckpt_dir: Path, mode: int) -> None:
        t0 = time.monotonic()
        try:
            done = persist.persist(self.snap, ckpt_dir, mode=mode, fsync=False)
        except BaseException as e:  # reported by the loop's thread
            self.result = e
            return
        self.seconds = time.monotonic() - t0
        self.result = done
        if not done.already:
            try:
                persist.make_durable(done.path)
            except OSError as e:
                self.fsync_error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def verdict(self) -> Verdict | None:
        """The checkpoint as the dir holds it once the copy is done; None when the copy failed
        (the dir's own newest stands)."""
        if self.done() and not isinstance(self.result, persist.Persisted):
            return None
        return Verdict(self.path, self.snap.step, Status.OK, manifest=self.snap.manifest)
