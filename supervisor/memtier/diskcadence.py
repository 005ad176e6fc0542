"""The disk tier under the memory tier: the worker's scheduled disk saves, written by rtrain.

With the memory tier on, a disk save that falls due on the worker's schedule is a snapshot
(worker/memtier/memory_tier.py) followed by a `persist` heartbeat; rtrain copies the newest snapshot
at that step or later into the checkpoint dir in a thread of its own (persist.py: hashed as it is
copied, pinned against the worker's removal), then prunes with the worker's Keep policy as the
snapshot's manifest records it (never a heartbeat's word: anyone who could send one would choose
what is deleted), never the step just committed nor the one the attempt resumed from. So the
training thread pays the snapshot, not the disk write. A step on disk already is left alone
unless it is an earlier save of it (a replay after a resume from an older checkpoint), replaced
as the worker's own save would replace it.
One copy runs at a time; a request that comes meanwhile waits, a newer one replacing it
(decide.requested). The thread never writes events: what it did is reported from the loop's thread
(`poll`, `settle`), where every event is written.

A copy that fails (a full disk, an unwritable dir) is said once, as a `snapshot_not_persisted`
event, until one succeeds again; the snapshot stays in memory and the next request tries again
(the attempt's end commits the newest snapshot in any case, loop.py).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint import runid
from rtrain.checkpoint.commit import remove_dir
from rtrain.checkpoint.layout import MANIFEST, checkpoint_name
from rtrain.checkpoint.verify import Level, Verdict, VerifiedCache, verify
from rtrain.supervisor.memtier import decide, persist, shmdir
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.supervisor.retention.prune_dir import prune

WHY = "disk cadence"
_RETRIES = 3  # a snapshot replaced while rtrain took it: the newer one is taken instead


@dataclass
class Done:
    """What one request's copy did (filled by the thread, reported by the loop's thread)."""

    request: decide.Request
    step: int | None = None  # the snapshot committed (None: nothing was)
    path: Path | None = None
    bytes: int = 0
    seconds: float = 0.0
    refused: list[tuple[Verdict, str]] = field(default_factory=list)
    policy: RetentionPolicy | None = None  # the Keep policy the committed snapshot records
    failed: str | None = None  # why the copy did not happen (a storage error)
    prune_failed: str | None = None


class DiskCadence:
    """One launch's persisting of the worker's disk saves, at most one copy at a time."""

    def __init__(self, shm: Path, ckpt_dir: Path, key: bytes | None, *, file_mode: int,
                 emit: Callable[..., Any], say: Callable[[str], None]) -> None:
        self.shm, self.ckpt_dir, self.key, self.file_mode = shm, ckpt_dir, key, file_mode
        self.emit, self.say = emit, say
        self.attempt = 0
        self.resumed: int | None = None  # the attempt's checkpoint: never pruned under it
        self._queue = decide.Queue()
        self._thread: threading.Thread | None = None
        self._done: Done | None = None
        self._failing = False  # a failure was said; said again only after a success
        self._verified = VerifiedCache()  # what rtrain copied (hashed as it was copied)

    def attempt_starting(self, attempt: int, resumed: int | None) -> None:
        self.attempt, self.resumed = attempt, resumed

    def request(self, step: int | None) -> None:
        """A `persist` heartbeat (the loop's thread)."""
        self.poll()
        if not isinstance(step, int) or isinstance(step, bool):
            return
        self._queue, start = decide.requested(self._queue, decide.Request(step))
        if start is not None:
            self._start(start)

    def poll(self) -> None:
        """Report a finished copy; start the request that waited for it (the loop's thread)."""
        t = self._thread
        if t is None or t.is_alive():
            return
        t.join()
        self._thread = None
        self._next(self._finish())

    def settle(self) -> None:
        """Wait for the running copy and make the one still asked for, here (an attempt's
        end: before anything else reads or commits to the checkpoint dir)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            nxt = self._finish()
            while nxt is not None:
                self._run(nxt)
                nxt = self._finish()

    def _next(self, nxt: decide.Request | None) -> None:
        if nxt is not None:
            self._start(nxt)

    def _start(self, req: decide.Request) -> None:
        self._thread = threading.Thread(target=self._run, args=(req,),
                                        name="rtrain-persist", daemon=True)
        self._thread.start()

    def _finish(self) -> decide.Request | None:
        """Report the copy just done; the request to run next."""
        done, self._done = self._done, None
        if done is None:
            self._queue, nxt = decide.finished(self._queue, None)
            return nxt
        self._report(done)
        self._queue, nxt = decide.finished(self._queue, done.step)
        return nxt

    def _report(self, done: Done) -> None:
        for v, reason in done.refused:
            self.emit("snapshot_refused", attempt=self.attempt, step=v.step, path=str(v.path),
                      reason=reason)
            self.say(f"memory snapshot of step {v.step} refused: {reason}; not persisted")
        if done.failed is not None:
            if not self._failing:
                self._failing = True
                self.emit("snapshot_not_persisted", attempt=self.attempt,
                          step=done.request.step, reason=done.failed)
                self.say(f"attempt {self.attempt}: could not persist the memory snapshot of "
                         f"step {done.request.step} to {self.ckpt_dir}: {done.failed}; it "
                         "stays in memory, and the next disk save tries again")
            return
        if done.step is None or done.path is None:
            return
        self._failing = False
        if done.prune_failed is not None:
            self.say(f"attempt {self.attempt}: pruning {self.ckpt_dir} after persisting step "
                     f"{done.step} failed: {done.prune_failed}")
        self.emit("snapshot_persisted", attempt=self.attempt, step=done.step,
                  path=str(done.path), bytes=done.bytes, seconds=round(done.seconds, 4),
                  why=WHY)

    def _run(self, req: decide.Request) -> None:
        """The copy and the pruning (in the thread, or in the loop's at `settle`)."""
        done = Done(req)
        try:
            self._copy(done)
        except OSError as e:
            done.failed = str(e.strerror or e)
        except Exception as e:  # never the supervisor's end: said, and the next request retries
            done.failed = f"{type(e).__name__}: {e}"
        if done.step is not None and done.policy is not None:
            protect = frozenset({done.step} | ({self.resumed} - {None}))
            try:
                prune(self.ckpt_dir, done.policy, key=self.key, protect=protect,
                      verified=self._verified)
            except OSError as e:  # the copy stands; the next one prunes again
                done.prune_failed = str(e.strerror or e)
        self._done = done

    def _copy(self, done: Done) -> None:
        for _ in range(_RETRIES):
            snap, refused = shmdir.newest(self.shm, self.key)
            for v in refused:
                if os.path.lexists(v.path):  # gone: replaced by a newer one, not damaged
                    done.refused.append((v, v.reason))
                    shmdir.discard_snapshot(v.path)
            if snap is None or snap.step < done.request.step:
                return  # dropped (memory pressure) or already taken by an attempt's end
            # Newer checkpoints on disk do not matter: the worker asked for this step (after a
            # rollback it replays steps saved before), as its own save would have written it.
            if not decide.worth_persisting(snap.step, None, same_run=runid.of(snap.manifest)
                                           == runid.read(self.ckpt_dir)):
                return
            final = self.ckpt_dir / checkpoint_name(snap.step)
            if snap.step != self.resumed and _replayed(final, snap):
                try:
                    remove_dir(final)  # as the worker's commit does with a step saved again
                except FileNotFoundError:
                    pass
            t0 = time.monotonic()
            try:
                out = persist.persist(snap, self.ckpt_dir, mode=self.file_mode)
            except persist.SnapshotRefused as e:
                if not os.path.lexists(snap.path):
                    continue  # the worker replaced it while rtrain took it: take the newer
                done.refused.append((snap, str(e)))
                shmdir.discard_snapshot(snap.path)
                return
            if out.already:
                return
            self._verified.add(verify(out.path, Level.QUICK, self.key))
            done.step, done.path, done.bytes = snap.step, out.path, out.bytes
            done.policy = decide.snapshot_policy(snap.manifest)
            done.seconds = time.monotonic() - t0
            return


def _replayed(final: Path, snap: Verdict) -> bool:
    """`final` (the snapshot's step on disk) is an earlier save of that step, which a replay
    after a resume from an older checkpoint replaces: other files, written before the
    snapshot. One written after it (the worker's own save of the step) stays."""
    try:
        old = mf.load(final)
        before = ((final / MANIFEST).stat().st_mtime_ns
                  < (snap.path / MANIFEST).stat().st_mtime_ns)
    except (OSError, mf.ManifestError):
        return False
    return before and old.get("files") != (snap.manifest or {}).get("files")
