"""The run's checkpoint dir as the loop sees it: which checkpoint an attempt resumes from
(`foreign.select_resume_any_format`, the same selection `rtrain status` shows) and whether the
child's encryption key can open it, the newest good step, whether an attempt committed one (by
step, or by new content in a foreign file: `ckpt/progress.py`), the quarantine copy other
readers of the dir see, and rtrain's copy of a foreign file the script rewrites in place
(`ckpt/keepcopy.py`): kept when a relaunch picks new content, put back when the file is torn.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from rtrain.checkpoint import crypt, quarantine, runid
from rtrain.checkpoint.verify import Level, Selection, Status, Verdict, mark_quarantined
from rtrain.supervisor.ckpt import foreign, keepcopy, progress, setaside
from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.untrusted_text import safe
from rtrain.supervisor.decide.policy import History, Resumed, ResumeMode
from rtrain.supervisor.proc.torchrun import several_nodes
from rtrain.supervisor.records.events import EventLog


class InFlight(Protocol):
    """A checkpoint being committed to the dir in the background (memtier/tier.py)."""

    def committing(self) -> Verdict | None:
        """It, as the dir will hold it; None when there is none (or its copy failed)."""

    def settle_sync(self) -> None:
        """Until it is in the dir (or failed)."""


class Checkpoints:
    def __init__(self, ckpt_dir: Path, config: Config, key: bytes | None, events: EventLog,
                 say: Callable[[str], None], enc: crypt.EncryptionKey | None = None,
                 run_dir: Path | None = None, own_files: bool = True) -> None:
        self.dir, self.cfg, self.key, self.events, self.say = ckpt_dir, config, key, events, say
        # False: the dir is the script's (launch/ckpt_owner.py): the run identity stays in
        # memory, never written there.
        self.own_files = own_files
        self.enc = enc  # RTRAIN_ENCRYPTION_KEY(_FILE), which the child inherits
        self.run_dir = run_dir  # where rtrain's copy of an in-place foreign file lives
        self.restored: str | None = None  # the last pick put the copy back: for the launch line
        self._seen: tuple | None = None  # (path, size, mtime_ns) at the last sample
        self._tried: tuple | None = None  # the last one a copy was attempted of
        # The copy taken while an attempt runs reads and verifies the whole file: a thread of
        # its own, so the watch loop goes on draining output and heartbeats meanwhile.
        self._copying: threading.Thread | None = None
        self._copied: list[tuple[Path, keepcopy.Kept | OSError | None]] = []
        # Where a newer checkpoint of the run may be found than in the local dir (the mirror):
        # given the local pick and when the run started over, brings it into the dir; True
        # when it did.
        self.fetch_newer: Callable[[Verdict | None, float | None], bool] | None = None
        self._looked_remote = False
        self.run: str | None = None  # this launch's run identity, settled at its first pick
        self._said_ignored = False  # a kept.json rtrain cannot trust was said
        # The memory tier's commit of an attempt's last state, copied while the relaunch
        # starts: the pick and the progress rule count it as in the dir.
        self.in_flight: InFlight | None = None

    def pick(self, history: History, resume: ResumeMode, *, first: bool) -> Selection | None:
        """The checkpoint the next attempt resumes from; None when an explicit --resume PATH
        does not verify. `first`: the first attempt of a new run (--resume applies)."""
        level = Level(self.cfg.verify)
        self.settle_copy()  # one writer of rtrain's copy at a time
        if first and self.cfg.resume == "never":
            self._settle_run(None, start_over=True)
            return Selection(None, [])
        if first and self.cfg.resume != "auto":
            v = foreign.verify_path(self.cfg.resume, level, self.key)
            if not v.ok:
                raise UsageError(f"--resume {self.cfg.resume} does not verify ({v.describe()}): "
                                 "pick another checkpoint or use --resume auto")
            self._settle_run(v)
            return self._openable(Selection(v, []))
        # Any format: rtrain's own, a Trainer's checkpoint-N dirs, Lightning / torch.save files.
        self.restored = self._restore_torn(level)
        pending = self._committing()
        if pending is not None and resume is ResumeMode.LATEST \
                and foreign.resume_identity(pending) not in history.bad_checkpoints:
            # Newer than all the dir holds (it is committed only then), every byte hashed by
            # rtrain before this pick and again as it is copied: the pick, without reading
            # the dir.
            self._settle_run(pending)
            return Selection(pending, [])
        if pending is not None and self.in_flight is not None:
            self.in_flight.settle_sync()  # a rollback, or a state a worker could not load
        sel = self._select(level, history, skip_newest=1 if resume is ResumeMode.ROLLBACK else 0)
        if (self.fetch_newer is not None and not self._looked_remote
                and resume is ResumeMode.LATEST):
            # Once per launch: only a fresh machine (or a lost local dir) can have a newer
            # checkpoint on the mirror than on its disk, since every upload starts from here.
            self._looked_remote = True
            if self.fetch_newer(sel.chosen, history.started_over):
                sel = self._select(level, history)
        newest = None
        if resume is ResumeMode.ROLLBACK and sel.chosen is None:
            newest = self._select(level, history)  # nothing older: newest
        self._locked_out(sel.skipped, newest or sel)
        for v in sel.skipped:
            self.say(f"skipping {safe(v.path.name)}: {safe(v.describe())}")  # names from disk
            self.events.emit("skipped_checkpoint", path=str(v.path), reason=v.describe())
        sel = newest or sel
        self._settle_run(sel.chosen)
        self._keep(sel.chosen)
        return sel

    def _locked_out(self, skipped: list[Verdict], sel: Selection) -> None:
        """A checkpoint this run's key cannot open (encrypted under another key, or with no
        key given) is skipped like any unusable one when the pick below it is one this run
        wrote as it writes now: encrypted under its key, or plaintext when it has none. That
        is a checkpoint of another run or key dropped into the dir. When there is no such
        pick, the run's own checkpoints are the ones it cannot open (a wrong or missing key):
        a UsageError naming the fingerprints (exit 2) before any attempt, rather than a fresh
        start or a resume from older plaintext that would hide it."""
        locked = [v for v in skipped if v.status is Status.WRONG_KEY]
        if not locked or self._written_as_now(sel.chosen):
            return
        raise UsageError(f"cannot resume from {safe(locked[0].path.name)}: "
                         f"{safe(locked[0].reason)}")

    def _written_as_now(self, chosen: Verdict | None) -> bool:
        if chosen is None:
            return False
        if chosen.format != "rtrain" or chosen.manifest is None:
            return self.enc is None  # foreign checkpoints are never encrypted
        try:
            entry = crypt.scheme_of(chosen.manifest)
        except crypt.CryptError:
            return False
        if self.enc is None:
            return entry is None
        return entry is not None and entry["key_fingerprint"][:32] == self.enc.fingerprint

    def _key_problem(self, v: Verdict) -> str | None:
        """Why the child's key cannot open `v`, which verified; None when it can."""
        if v.format != "rtrain" or v.manifest is None:
            return None
        try:
            return crypt.key_problem(v.manifest, self.enc)
        except crypt.CryptError as e:
            return str(e)

    def start_over(self, history: History, now: float, command: list[str]) -> History:
        """The first attempt of a run started over (`--resume never`): set the earlier run's
        checkpoints aside (`ckpt/setaside.py`), so that the run owns only its own from now on,
        and remember when (the mirror's older checkpoints are the earlier run's too).

        Not under several nodes (`--nnodes` above 1): each node's rtrain would move what it
        finds, and one that starts late (elastic, or a lost node back as a new machine) would
        move the group's new checkpoints. Said, and the dir left as it is."""
        history = replace(history, started_over=now)
        self._looked_remote = True  # this launch's picks: the local dir has all the run wrote
        if several_nodes(command):
            self.say(f"--resume never under several nodes: checkpoints already in {self.dir} "
                     "are not set aside, and a relaunch may resume from them: start a run "
                     "over in an empty --ckpt-dir")
            return history
        try:
            done = setaside.set_aside(self.dir, now, file_mode=self.cfg.file_mode)
        except OSError as e:
            self.say(f"cannot set the earlier run's checkpoints in {self.dir} aside "
                     f"({e.strerror or e}): a relaunch may resume from them")
            return history
        if done is None:
            return history
        if self.run_dir is not None:
            keepcopy.forget(self.run_dir)  # rtrain's copy was of the earlier run's file
        shown = ", ".join(safe(n) for n in done.names[:4])
        more = f" and {len(done.names) - 4} more" if len(done.names) > 4 else ""
        self.say(f"starting over: {len(done.names)} checkpoint(s) of an earlier run ({shown}"
                 f"{more}) moved to {safe(str(done.path))}")
        self.events.emit("checkpoints_set_aside", path=str(done.path), names=list(done.names))
        return history

    def _settle_run(self, chosen: Verdict | None, *, start_over: bool = False) -> None:
        """Once per launch, at its first pick: the run identity its checkpoints get and its
        uploader sends (`checkpoint/runid.py`), written to the checkpoint dir when it changes."""
        if self.run is not None:
            return
        current = runid.read(self.dir)
        resumed = runid.of(chosen.manifest) if chosen is not None else None
        run = runid.settle(current, resumed, start_over=start_over) or runid.new()
        if run == current or not self.own_files:
            self.run = run
            return
        try:
            # Claimed where there is none: the nodes of one run share the dir and settle at once.
            self.run = runid.write(self.dir, run, self.cfg.file_mode, replace=current is not None)
        except OSError as e:
            self.run = run
            self.say(f"cannot write the run identity in {self.dir} ({e.strerror}); its "
                     "checkpoints name no run and none of them is uploaded")

    def _keep(self, chosen: Verdict | None) -> None:
        """Copy the chosen checkpoint into the run dir when it is a foreign file the script
        will rewrite in place and its content is new: the next kill mid-write can only cost
        the attempt's own progress. A full disk costs the copy (said), never the launch."""
        if self.run_dir is None or not keepcopy.wants_copy(chosen):
            return
        assert chosen is not None
        try:
            kept = keepcopy.keep(self.run_dir, chosen, mode=self.cfg.file_mode)
        except OSError as e:
            kept = e
        self._report_copy(chosen.path, kept)

    def _report_copy(self, path: Path, kept: keepcopy.Kept | OSError | None) -> None:
        if isinstance(kept, OSError):
            self.say(f"cannot keep a copy of {safe(path.name)} ({kept.strerror or kept}): a "
                     "kill while the script rewrites it may lose it")
        elif kept is not None:
            self.events.emit("foreign_copy_kept", path=kept.source, step=kept.step,
                             bytes=kept.bytes, how=kept.how)

    def settle_copy(self) -> None:
        """Wait for a copy in flight, and report the copies taken since the last look."""
        if self._copying is not None:
            self._copying.join()
            self._copying = None
        self._collect_copies()

    def _collect_copies(self) -> None:
        while self._copied:
            self._report_copy(*self._copied.pop(0))

    def watch_keep(self) -> None:
        """At each sample while an attempt runs: once the newest in-place foreign file has
        settled (the same size and mtime two samples running) with new content that verifies,
        copy it, so a kill during the script's next rewrite costs only the steps since."""
        if self.run_dir is None:
            return
        self._collect_copies()
        if self._copying is not None and self._copying.is_alive():
            return
        # Names and times only: the pickle walk belongs to the copy thread's verification.
        c = next((c for c in foreign.list_candidates(self.dir, read_steps=False)
                  if not c.is_dir), None)
        if c is None or foreign.step_from_name(c.path.name) is not None:
            return
        try:
            st = c.path.stat()
        except OSError:
            return
        seen = (str(c.path), st.st_size, st.st_mtime_ns)
        if seen != self._seen:  # still being written, or just written: look again next time
            self._seen = seen
            return
        if seen == self._tried:
            return
        self._tried = seen
        self._copying = threading.Thread(target=self._keep_in_background, args=(c,),
                                         name="rtrain-foreign-copy", daemon=True)
        self._copying.start()

    def _keep_in_background(self, c: foreign.Candidate) -> None:
        """The copy thread: verify, copy, verify the copy; the result for the loop to report
        (events are written by the loop's thread only)."""
        assert self.run_dir is not None
        try:
            v = foreign.verify_candidate(c, Level.QUICK, self.key)
            kept = (keepcopy.keep(self.run_dir, v, mode=self.cfg.file_mode)
                    if keepcopy.wants_copy(v) else None)
        except OSError as e:
            kept = e
        self._copied.append((c.path, kept))

    def _restore_torn(self, level: Level) -> str | None:
        """Put rtrain's copy back when the file it was taken from fails verification (torn by
        a kill mid-write, or replaced by something refused); the sentence said, or None."""
        if self.run_dir is None:
            return None
        kept, ignored = keepcopy.read(self.run_dir)
        if ignored is not None and not self._said_ignored:
            self._said_ignored = True  # one line a launch: it is read at every pick
            self.say(f"ignored {safe(str(self.run_dir / keepcopy.KEPT_DIR / keepcopy.RECORD))}"
                     f": {safe(ignored)}; nothing is restored from it")
        if kept is None or Path(kept.source).parent != self.dir.resolve():
            return None
        live = Path(kept.source)
        why = keepcopy.torn(live, level)
        if why is None:
            return None
        name, at = safe(live.name), time.strftime("%Y-%m-%d %H:%M:%S",
                                                   time.localtime(kept.verified_at))
        copy = foreign.verify_path(kept.copy_path(self.run_dir), Level.FULL)
        if not copy.ok:
            self.say(f"{name} was torn ({safe(why)}); rtrain's copy of it does not verify "
                     f"either ({safe(copy.describe())})")
            return None
        try:
            keepcopy.restore(self.run_dir, kept, mode=self.cfg.file_mode)
        except OSError as e:
            self.say(f"{name} was torn ({safe(why)}); cannot restore rtrain's copy "
                     f"({e.strerror or e})")
            return None
        # A kill mid-write tears a file; a directory or an unsafe pickle there was put there.
        verb = "was refused" if why.startswith("a directory") or "pickle calls" in why \
            else "was torn"
        line = f"{name} {verb} ({safe(why)}); restored rtrain's copy of the content verified " \
               f"at {at}"
        self.say(line)
        self.events.emit("foreign_restored", path=kept.source, reason=why, step=kept.step,
                         verified_at=kept.verified_at)
        return line

    def snapshot(self) -> dict[str, progress.Mark]:
        """Each foreign file candidate's content when an attempt starts (`ckpt/progress.py`)."""
        return {str(c.path): progress.Mark(str(c.path), progress.fingerprint(c.path), c.step)
                for c in foreign.list_candidates(self.dir) if not c.is_dir}

    def progressed(self, before: dict[str, progress.Mark]) -> progress.Mark | None:
        """The foreign file whose new content, verified, shows the attempt made progress."""
        after = []
        for c in foreign.list_candidates(self.dir):
            if c.is_dir:
                continue
            fp = progress.fingerprint(c.path)
            old = before.get(str(c.path))
            if fp is None or (old is not None and old.fingerprint == fp):
                continue  # unchanged: no need to verify it
            v = foreign.verify_candidate(c, Level.QUICK, self.key)
            after.append(progress.Mark(str(c.path), fp, v.step if v.step >= 0 else None,
                                       v.ok))
        return progress.advanced(before, after)

    def _openable(self, sel: Selection) -> Selection:
        """`sel` (an explicit --resume PATH), unless its checkpoint is encrypted and the
        child's key cannot open it: then a UsageError naming the fingerprints, before any
        attempt starts."""
        chosen = sel.chosen
        problem = None if chosen is None else self._key_problem(chosen)
        if problem is not None:
            assert chosen is not None
            raise UsageError(f"cannot resume from {safe(chosen.path.name)}: {problem}")
        return sel

    def _select(self, level: Level, history: History, skip_newest: int = 0) -> Selection:
        """Passing over quarantined checkpoints and those a worker of this run could not load
        (reported when that happened, in a `skipped_checkpoint` event)."""
        return foreign.select_resume_any_format(self.dir, level, self.key, skip_newest,
                                                exclude=history.bad_checkpoints,
                                                key_problem=self._key_problem)

    def _committing(self) -> Verdict | None:
        return self.in_flight.committing() if self.in_flight is not None else None

    def newest_step(self) -> int | None:
        pending = self._committing()
        verdicts = (foreign.verify_candidate(c, Level.QUICK, self.key)
                    for c in foreign.list_candidates(self.dir))
        for v in mark_quarantined(self.dir, verdicts):
            if v.ok:
                step = v.step if v.step >= 0 else None
                if pending is not None and (step is None or pending.step > step):
                    return pending.step
                return step
        return pending.step if pending is not None else None

    def committed_since(self, started: float, resumed: Resumed | None) -> bool:
        """Did the attempt commit a checkpoint newer than the one it resumed from? (A rollback
        resumes below the newest, so the newest step alone cannot tell.) `started` is unix
        time, compared with the checkpoints' mtimes."""
        floor = resumed.step if resumed is not None and resumed.step is not None else -1
        pending = self._committing()
        if pending is not None and pending.step > floor:
            return True  # committed at this attempt's end, still being copied
        for c in foreign.list_candidates(self.dir):
            if c.step is None or c.step <= floor:
                continue
            try:
                # A commit renames a dir whose manifest was written last: its mtime is the save's.
                if c.path.stat().st_mtime >= started:
                    return True
            except FileNotFoundError:
                continue
        return False

    def publish_quarantine(self, history: History) -> None:
        """state.json is the record; the checkpoint dir's copy is what readers of the dir see.
        A dir rtrain cannot write (read-only, full) costs that copy, never the run (nor can any
        checkpoint have been saved there to be quarantined)."""
        try:
            quarantine.publish(self.dir, history.quarantined, mode=self.cfg.file_mode)
        except OSError as e:
            self.say(f"cannot write {quarantine.QUARANTINE_FILE} in {self.dir} "
                     f"({e.strerror}): other readers of the dir will not see the quarantine")


def encryption_key() -> crypt.EncryptionKey | None:
    """The key the child inherits (RTRAIN_ENCRYPTION_KEY / _FILE), checked here so a bad key
    file or a missing `cryptography` package is one line at launch, not a child's traceback.
    Only the package's presence is checked: the supervisor never encrypts."""
    import importlib.util

    enc = crypt.load_encryption_key()
    if enc is not None and importlib.util.find_spec("cryptography") is None:
        raise UsageError(f"{crypt.ENV_KEY} is set, but encrypting checkpoints needs the "
                         f"cryptography package: {crypt.INSTALL_HINT}")
    return enc


def resumed_from(chosen: Verdict | None) -> Resumed | None:
    """The checkpoint's identity before the attempt runs: what a quarantine would name. A
    foreign checkpoint whose name states no step has step -1: unknown."""
    if chosen is None:
        return None
    return Resumed(path=str(chosen.path), step=chosen.step if chosen.step >= 0 else None,
                   id=quarantine.checkpoint_id(chosen.path))
