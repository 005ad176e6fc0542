"""The memory tier as a launch runs it: the directory each attempt gets, the snapshot committed
when an attempt ends (before the next pick reads the checkpoint dir), the relaunch pointed at
the snapshot when it is the checkpoint picked, the tier dropped on memory pressure, and the
directory removed when the launch ends (docs/architecture.md, "Saving at the right moments")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rtrain.checkpoint import parts, runid
from rtrain.checkpoint.verify import Verdict
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, ENV_MEMORY_RESUME, Heartbeat
from rtrain.supervisor.memtier import decide, live_seal, persist, shmdir
from rtrain.supervisor.memtier.background_commit import BackgroundCommit
from rtrain.supervisor.memtier.diskcadence import DiskCadence

if TYPE_CHECKING:  # several nodes only: imported when they are (a launch starts faster)
    from rtrain.supervisor.memtier.peerside import PeerSide


class MemoryTierDir:
    """One launch's use of the run's memory-tier directory."""

    def __init__(self, ckpt_dir: Path, key: bytes | None, emit: Callable[..., Any],
                 say: Callable[[str], None], *, file_mode: int = DEFAULT_FILE_MODE,
                 path: Path | None = None) -> None:
        self.ckpt_dir, self.key, self.emit, self.say = ckpt_dir, key, emit, say
        self.file_mode = file_mode
        self.path = path if path is not None else shmdir.path_for(ckpt_dir)
        self.unusable: str | None = None
        self.attempt = 0
        self._dropped: int | None = None  # the attempt whose tier was dropped
        # The worker's disk saves while the tier is on: copied here, in the background.
        self.disk = DiskCadence(self.path, ckpt_dir, key, file_mode=file_mode, emit=emit,
                                say=say)
        self.peers: PeerSide | None = None  # several nodes: copies to and from peer nodes
        # Whether the next attempt's process group may resume from parts newer than the pick
        # (not on a rollback, nor from a checkpoint the user named).
        self.newest_allowed = True
        self._said_on = False  # what snapshots cost, said once a launch
        self._said_off: str | None = None  # why the worker turned it off, said once a launch
        self._said_live: str | None = None  # the live state's news, said once a launch
        self._sync: threading.Thread | None = None  # an attempt's commit being fsynced
        self._pending: BackgroundCommit | None = None  # a sealed state being committed

    def enable_peers(self, host: str, port: int = 0, rdzv_host: str | None = None) -> None:
        """Several nodes: serve this node's snapshots to peers and copy theirs (peerside.py)."""
        from rtrain.supervisor.memtier.peerside import PeerSide

        self.peers = PeerSide(self.path, self.ckpt_dir, self.key, host, self.emit, self.say,
                              port=port, rdzv_host=rdzv_host)

    def env(self) -> dict[str, str]:
        """What the attempt's environment gets: the directory, unless it cannot be used."""
        if self.unusable:
            return {}
        return {ENV_MEMORY_DIR: str(self.path),
                ENV_MEMORY_RESUME: "1" if self.newest_allowed else "0"}

    def attempt_starting(self, attempt: int, resumed: int | None = None) -> None:
        self.attempt = attempt
        self.disk.attempt_starting(attempt, resumed)
        if self.unusable:
            return
        run = runid.read(self.ckpt_dir)
        try:
            shmdir.prepare(self.path, run)
        except (shmdir.Unusable, OSError) as e:
            self.unusable = str(e)
            self.say(f"memory tier unavailable for this launch: {e}")
            return
        peers = self.peers
        if peers is not None and (peers.started or peers.wanted(run)) and self._start_peers(run):
            peers.gather(attempt)  # before the ranks start: they pick from what is here

    def _start_peers(self, run: str | None) -> bool:
        """Serve and copy (once per launch); False when this node cannot serve."""
        if self.peers is None:
            return False
        from rtrain.supervisor.memtier.peerside import PeersOff

        try:
            self.peers.start(run)
        except PeersOff as e:
            self.say(f"peer copies of the memory tier off for this launch: {e}")
            self.peers = None
            return False
        except OSError as e:
            self.say(f"peer copies of the memory tier off for this launch: cannot serve on "
                     f"{self.peers.host}: {e.strerror or e}")
            self.peers = None
            return False
        return True

    def commit_newest(self, disk_newest: int | None, why: str, *,
                      durable_later: bool = False, background: bool = False) -> int | None:
        """Commit the newest good snapshot when it is newer than the checkpoint dir's newest;
        its step, else None. Under torchrun: the newest step the ranks' parts make whole.
        `durable_later`: an attempt's end, whose relaunch waits for this: the copy is
        committed without fsync and made durable in the background (`_sync`) while the
        relaunch starts; anything that prunes or commits next waits for that first.
        `background`: when the newest is the live state sealed just now, the whole copy runs
        in the background (background_commit.py) and the pick counts it as committed
        (`committing`)."""
        self.settle_sync()
        self.disk.settle()  # a disk-cadence copy in flight commits (or fails) first
        sealed = self._seal_live(disk_newest)
        snap = self._newest()
        if snap is None:
            return self._commit_group(disk_newest, why)
        same_run = runid.of(snap.manifest) == runid.read(self.ckpt_dir)
        if not decide.worth_persisting(snap.step, disk_newest, same_run=same_run):
            return None
        if background and self._read_as_is(snap, sealed):
            self._pending = BackgroundCommit(snap, self.ckpt_dir, mode=self.file_mode, why=why,
                                             attempt=self.attempt)
            return snap.step
        try:
            return self._committed(snap.step, why, lambda: persist.persist(
                snap, self.ckpt_dir, mode=self.file_mode, fsync=not durable_later),
                durable_later)
        except persist.SnapshotRefused as e:
            self._refused(snap, str(e))
            return None

    def _read_as_is(self, snap: Verdict, sealed: live_seal.Sealed | None) -> bool:
        """Whether rtrain hashed every byte of `snap` (so the relaunch may read it unhashed
        before its copy is made): sealed just now, or hashed here, in place. A snapshot that
        does not match its manifest is refused, as its copy would refuse it."""
        if sealed is not None and sealed.path == snap.path:
            return True
        try:
            persist.check_content(snap)
        except persist.SnapshotRefused:
            return False  # the copy below refuses it, saying why
        return True

    def committing(self) -> Verdict | None:
        """The checkpoint being committed in the background, as the dir will hold it (the
        pick and the progress rule count it: launch/resume.py); None when there is none."""
        return self._pending.verdict() if self._pending is not None else None

    def settle_sync(self) -> None:
        """The background commit and fsync of the last attempt's state are done (before a
        commit or a prune: never a checkpoint pruned while the newer one is not yet on the
        disk)."""
        if self._pending is not None:
            self._pending.wait()
            self._report_pending()
        if self._sync is not None:
            self._sync.join()
            self._sync = None

    def _report_pending(self) -> None:
        """Said and recorded from the loop's thread, once the background commit ended."""
        c, self._pending = self._pending, None
        if c is None:
            return
        r = c.result
        if isinstance(r, persist.SnapshotRefused):
            self._refused(c.snap, str(r))
        elif isinstance(r, OSError):
            self.say(f"could not commit the memory snapshot of step {c.snap.step} to "
                     f"{self.ckpt_dir}: {r.strerror or r}; it stays in memory")
        elif isinstance(r, BaseException):
            raise r
        elif r is not None and not r.already:
            if c.fsync_error is not None:
                self.say(f"could not fsync {r.path.name}: "
                         f"{c.fsync_error.strerror or c.fsync_error}; it stays committed, "
                         "verified when it is next read")
            self._persisted(c.snap.step, r, c.seconds, c.why, c.attempt)

    def _make_durable(self, path: Path) -> None:
        try:
            persist.make_durable(path)
        except OSError as e:
            self.say(f"could not fsync {path.name}: {e.strerror or e}; it stays committed, "
                     "verified when it is next read")

    def _seal_live(self, disk_newest: int | None) -> live_seal.Sealed | None:
        """The worker's live state, when it holds a whole step newer than its snapshots: a
        snapshot now (live_seal.py), which the lines below commit like any other."""
        if self.unusable:
            return None
        t0 = time.monotonic()
        try:
            sealed = live_seal.seal(self.path, self.key, disk_newest)
        except (live_seal.NotSealed, OSError) as e:
            self.say(f"the live state of attempt {self.attempt} was not sealed: {e}")
            return None
        if sealed is not None:
            self.emit("snapshot_sealed", attempt=self.attempt, step=sealed.step,
                      bytes=sealed.bytes, seconds=round(time.monotonic() - t0, 4))
        return sealed

    def _commit_group(self, disk_newest: int | None, why: str) -> int | None:
        """A process group's newest whole step, as the checkpoint a collective save writes. Not
        under several nodes: the survivors' parts then resume the group from memory, and each
        node's copy would race the others' on the shared dir."""
        if self.unusable or self.peers is not None:
            return None
        run = runid.read(self.ckpt_dir)
        found = [p for p in parts.list_parts(self.path, self.key) if p.run == run]
        whole = parts.whole_steps([(p.rank, p.step, p.world_size, p.run) for p in found], run)
        if not whole or not decide.worth_persisting(whole[0][0], disk_newest, same_run=True):
            return None
        step, size = whole[0]
        group = [p for r in range(size) if (p := parts.pick(found, step, r)) is not None]
        try:
            return self._committed(step, why, lambda: persist.persist_group(
                group, self.ckpt_dir, self.key, mode=self.file_mode))
        except persist.SnapshotRefused as e:
            self.emit("snapshot_refused", attempt=self.attempt, step=step,
                      path=str(self.path), reason=str(e))
            self.say(f"memory snapshot of step {step} (the ranks' parts) refused: {e}; "
                     "resuming from the disk tier")
            for p in group:  # never read again
                shmdir.discard_snapshot(p.path)
            return None

    def _committed(self, step: int, why: str, commit: Callable[[], persist.Persisted],
                   durable_later: bool = False) -> int | None:
        """Run `commit`; said and recorded as `snapshot_persisted`; the step, else None."""
        t0 = time.monotonic()
        try:
            done = commit()
        except OSError as e:
            self.say(f"could not commit the memory snapshot of step {step} to "
                     f"{self.ckpt_dir}: {e.strerror or e}; it stays in memory for the relaunch")
            return None
        seconds = time.monotonic() - t0
        if done.already:
            return None
        if durable_later:
            self._sync = threading.Thread(target=self._make_durable, args=(done.path,),
                                          name="rtrain-fsync", daemon=True)
            self._sync.start()
        self._persisted(step, done, seconds, why)
        return step

    def _persisted(self, step: int, done: persist.Persisted, seconds: float, why: str,
                   attempt: int | None = None) -> None:
        self.emit("snapshot_persisted", attempt=self.attempt if attempt is None else attempt,
                  step=step,
                  path=str(done.path), bytes=done.bytes, seconds=round(seconds, 4), why=why)
        self.say(f"committed the memory snapshot of step {step} as {done.path.name} "
                 f"({why}; {done.bytes / 2**20:.0f} MiB in {seconds:.2f} s)")

    def resume_path(self, chosen: Verdict | None) -> Path | None:
        """The snapshot to resume from instead of `chosen` (the same checkpoint, in memory)."""
        if chosen is None or chosen.manifest is None or self.unusable:
            return None
        snap = self._newest()
        if snap is None or snap.manifest is None:
            return None
        same = snap.manifest.get("files") == chosen.manifest.get("files")
        if decide.resume_from_memory(snap.step, chosen.step, same_files=same):
            return snap.path
        return None

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        """The worker's `snapshot` heartbeats (the tier started, changed interval or stopped)
        and `persist` heartbeats (a disk save, copied in the background)."""
        if hb.event == "persist":
            self.settle_sync()
            self.disk.request(hb.step)
            return
        self.disk.poll()  # the next copy starts as soon as the loop hears anything
        s = hb.snapshot
        if hb.event != "snapshot" or not isinstance(s, dict):
            return
        if "resumed" in s:  # a group resumed from its parts (worker/memtier/memory_resume.py)
            origin = "peer" if s.get("origin") == "peer" else "node"
            self.emit("snapshot_resumed", attempt=attempt, step=hb.step, origin=origin)
            self.say(f"attempt {attempt}: resumed from the memory snapshot of step {hb.step}"
                     f"{' (parts copied from a peer node)' if origin == 'peer' else ''}")
            return
        if "live" in s:  # the live state (worker/memtier/live.py) started or stopped
            line = live_line(s)
            if line != self._said_live:  # each attempt finds it again: said once
                self._said_live = line
                self.say(f"attempt {attempt}: {line}")
            return
        off = s.get("off")
        if not off and self.peers is not None and not self.unusable:
            self._start_peers(runid.read(self.ckpt_dir))  # the ranks' parts have a peer now
        costs = {k: s[k] for k in ("cost_s", "step_s", "bytes", "measured") if k in s}
        self.emit("memory_tier", attempt=attempt, step=hb.step,
                  state="off" if off else "on", every=s.get("every"),
                  stall_s=s.get("stall_s"), write_s=s.get("write_s"),
                  reason=str(off) if off else None, **costs)
        if off and off != self._said_off:  # each attempt finds it again: said once
            self._said_off = str(off)
            self.say(f"attempt {attempt}: memory tier off: {off}")
        elif s.get("measured") is True and not self._said_on:
            self._said_on = True
            self.say(f"memory tier on: {on_line(s, self.path)}")

    def poll(self) -> None:
        """At each watch sample: report a finished disk-cadence copy, start the next; the
        peer copies' news; a background commit that ended."""
        if self._pending is not None and self._pending.done():
            self._report_pending()
        self.disk.poll()
        if self.peers is not None:
            self.peers.poll()

    def drop(self, attempt: int, why: str) -> None:
        """Memory pressure: no more snapshots in this attempt, the ones there freed (once)."""
        if self.unusable or self._dropped == attempt:
            return
        self._dropped = attempt
        freed = shmdir.drop(self.path)
        self.emit("memory_tier", attempt=attempt, step=None, state="dropped", every=None,
                  stall_s=None, write_s=None, reason=why)
        self.say(f"attempt {attempt}: memory tier dropped ({freed / 2**20:.0f} MiB freed): "
                 f"{why}")

    def discard(self) -> None:
        """A run that starts over (`--resume never`): an earlier run's snapshots go."""
        shmdir.remove(self.path)

    def close(self, disk_newest: int | None) -> None:
        """The launch ends: the newest snapshot committed if it is newer, the directory removed."""
        self.commit_newest(disk_newest, "run ended")
        self.settle_sync()
        if self.peers is not None:
            self.peers.close()
        shmdir.remove(self.path)

    def _newest(self) -> Verdict | None:
        snap, refused = shmdir.newest(self.path, self.key)
        for v in refused:
            self._refused(v, v.reason)
        return snap

    def _refused(self, snap: Verdict, reason: str) -> None:
        self.emit("snapshot_refused", attempt=self.attempt, step=snap.step, path=str(snap.path),
                  reason=reason)
        self.say(f"memory snapshot of step {snap.step} refused: {reason}; resuming from the "
                 "disk tier")
        shmdir.discard_snapshot(snap.path)


def live_line(s: dict[str, Any]) -> str:
    """The worker's news of its live state: on (with its size), or off and why."""
    live, nbytes = s.get("live"), s.get("bytes")
    if live != "on":
        return f"live state off: {live}"
    size = ""
    if isinstance(nbytes, int) and not isinstance(nbytes, bool):
        size = (f"{nbytes / 2**20:.0f} MiB of " if nbytes >= 2**20
                else f"{nbytes / 1024:.0f} KiB of ")
    return (f"live state on: {size}parameters and optimizer state kept in shared memory (a "
            "kill outside optimizer.step() loses no step)")


def on_line(s: dict[str, Any], path: Path) -> str:
    """What the worker measured of its snapshots, for the launch's one line about them."""
    def num(key: str) -> float | None:
        v = s.get(key)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    every, cost, step, nbytes = num("every"), num("cost_s"), num("step_s"), num("bytes")
    parts = [f"snapshots in {path}"]
    if nbytes is not None:
        size = f"{nbytes / 2**20:.0f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.0f} KiB"
        parts[0] = f"snapshots of {size} in {path}"
    if cost is not None:
        parts.append(f"each costs the steps {cost * 1e3:.1f} ms"
                     + (f" of a {step * 1e3:.0f} ms step" if step else ""))
    if every is not None:
        n = int(every)
        parts.append(f"one every {n} step{'s' if n != 1 else ''}"
                     + (f" ({cost / (n * step):.1%} of the step time)" if cost is not None
                        and step else ""))
    return ", ".join(parts)
