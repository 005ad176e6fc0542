"""The uploader: a process of its own that copies committed checkpoints to the mirror.

`rtrain launch --mirror URL` starts it once per launch (`mirror/launch_uploads.py`) and it outlives
every attempt: a crash of the training child never interrupts an upload, and a hung or slow
store never holds up the supervisor, which only reads this process's messages. It watches the
checkpoint dir, sends the newest committed checkpoint of this run first (`backlog.next_upload`;
which ones may go: `outgoing`), the manifest last (the remote commit marker), retries failures
with a capped backoff, and applies the mirror's retention to this run's checkpoints after each
upload. Checkpoints of another run under the same URL count for nothing here: they neither
stand for this run's on the mirror nor are they replaced or deleted.

    python -m rtrain.supervisor.mirror.uploader SPEC_JSON

Talks over pipes: stdin takes commands, one per line ("finish": send what is still waiting,
then exit; end of input means the same); stdout carries one JSON object per line (`kind`:
started, uploaded, failed, refused, other_run, superseded, pruned, standby, final). It writes
nothing else anywhere but the mirror and its lock file. Credentials come from the backend's own
chain and never appear in a message (errors say what failed, never with what).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import runid
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.mirror import backlog
from rtrain.supervisor.mirror.backend import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, Timeouts
from rtrain.supervisor.mirror.outgoing import Outgoing

# One uploader per checkpoint dir: on a shared filesystem every node's rtrain starts one, and
# only the holder of this lock sends; the others stand by and take over if it goes away.
LOCK_NAME = ".rtrain-mirror.lock"
POLL_S = 0.5  # how often the checkpoint dir is listed: a listing costs microseconds
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0  # an outage of minutes is caught up within this long of its end
STANDBY_RETRY_S = 5.0


@dataclass(frozen=True)
class Spec:
    ckpt_dir: Path
    url: str
    keep_remote: int
    milestone_every: int
    parallel: int
    file_mode: int = 0o600
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    read_timeout_s: float = READ_TIMEOUT_S

    @classmethod
    def parse(cls, text: str) -> Spec:
        raw = json.loads(text)
        return cls(Path(raw["ckpt_dir"]), raw["url"], int(raw["keep_remote"]),
                   int(raw["milestone_every"]), int(raw["parallel"]), int(raw["file_mode"]),
                   float(raw["connect_timeout_s"]), float(raw["read_timeout_s"]))

    def dumps(self) -> str:
        return json.dumps({"ckpt_dir": str(self.ckpt_dir), "url": self.url,
                           "keep_remote": self.keep_remote,
                           "milestone_every": self.milestone_every, "parallel": self.parallel,
                           "file_mode": self.file_mode,
                           "connect_timeout_s": self.connect_timeout_s,
                           "read_timeout_s": self.read_timeout_s})


def retry_after(failures: int) -> float:
    """Seconds before the next try after `failures` failures in a row (1, 2, 4, ... 30)."""
    return min(RETRY_FIRST_S * 2 ** max(failures - 1, 0), RETRY_MAX_S)


def send(kind: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


class Commands:
    """stdin, read without blocking: the supervisor's "finish", or its end (it went away)."""

    def __init__(self) -> None:
        self.finishing = False
        self._buf = b""

    def wait(self, timeout: float) -> None:
        if self.finishing:
            time.sleep(min(timeout, POLL_S))
            return
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], max(timeout, 0.0))
        if not ready:
            return
        chunk = os.read(sys.stdin.fileno(), 4096)
        if not chunk or b"finish" in self._buf + chunk:
            self.finishing = True
        self._buf = (self._buf + chunk)[-64:]


class Uploader:
    """The loop of the uploader process. `run`: this run's identity (`checkpoint/runid.py`): only
    its checkpoints go up (`outgoing`), and only its checkpoints on the mirror count as sent;
    another run's under the same URL are said once and left alone. `key`: the signing key,
    when one is set (unsigned checkpoints are neither sent nor counted)."""

    def __init__(self, spec: Spec, mirror: Any, commands: Commands, *, run: str | None,
                 key: bytes | None = None) -> None:
        self.spec, self.mirror, self.commands = spec, mirror, commands
        self.run_id, self.key = run, key
        self.outgoing = Outgoing(spec.ckpt_dir, run, key)
        self.remote: set[int] | None = None  # this run's, committed and verified on the mirror
        self.others: dict[int, str | None] = {}  # committed on the mirror by another run
        self.resend: set[int] = set()  # this run's on the mirror that failed their check
        self.given_up: dict[int, str] = {}  # step -> why it will not be sent
        self.told_superseded: set[int] = set()
        self.told_refused: set[tuple[str, str]] = set()
        self.told_others: set[int] = set()
        self.failures = 0
        self.retry_at = 0.0

    def run(self) -> int:
        while True:
            self._follow_identity()
            if self.remote is None and not self._list_remote():
                if self.commands.finishing:
                    return self._final()
                self.commands.wait(self.retry_at - time.monotonic())
                continue
            plan = backlog.next_upload(self._local(), self.remote,
                                       milestone_every=self.spec.milestone_every,
                                       given_up=self.given_up)
            # Said once a newer one is across, not when it is planned: a newest that then fails
            # its hashes supersedes nothing.
            across = max(self.remote, default=-1)
            fresh = [s for s in plan.superseded if s not in self.told_superseded and s < across]
            if fresh:
                self.told_superseded.update(fresh)
                send("superseded", steps=sorted(fresh))
            if plan.upload is None:
                if self.commands.finishing:
                    return self._final()
                self.commands.wait(POLL_S)
                continue
            wait = self.retry_at - time.monotonic()
            if wait > 0:
                self.commands.wait(wait)
                continue
            self._upload(plan.upload)

    def _follow_identity(self) -> None:
        """Another node's launch may settle the shared dir's identity after this one started:
        the checkpoints follow the file, and so does what counts as this run's here."""
        now = runid.read(self.spec.ckpt_dir)
        if now is None or now == self.run_id:
            return
        self.run_id = now
        self.outgoing = Outgoing(self.spec.ckpt_dir, now, self.key)
        self.remote = None  # listed again: which remote checkpoints are this run's changed

    def _local(self) -> list[int]:
        """The steps that may go up; each refusal said once (`refused`)."""
        ok, refused = self.outgoing.scan()
        for r in refused:
            if (r.name, r.reason) not in self.told_refused:
                self.told_refused.add((r.name, r.reason))
                send("refused", step=r.step, name=r.name, reason=r.reason)
        return ok

    def _list_remote(self) -> bool:
        from rtrain.checkpoint.verify import Level
        from rtrain.supervisor.mirror.store import MirrorError, checkpoints
        from rtrain.supervisor.mirror.verify_remote import verify_remote

        mine: set[int] = set()
        others: dict[int, str | None] = {}
        resend: set[int] = set()
        try:
            inventory = self.mirror.inventory()
            for rc in checkpoints(inventory):
                if not rc.committed:
                    continue
                v = verify_remote(self.mirror, rc, Level.QUICK, self.key, inventory[rc.name])
                theirs = runid.of(v.manifest)
                if v.manifest is not None and theirs != self.run_id:
                    others[rc.step] = theirs
                elif v.ok:
                    mine.add(rc.step)
                else:
                    resend.add(rc.step)  # not counted as sent: this run's copy goes again
        except MirrorError as e:
            self._failed(None, str(e))
            return False
        self.remote, self.others, self.resend = mine, others, resend
        self.failures = 0
        send("started", remote_steps=sorted(mine))
        if set(others) - self.told_others:
            self.told_others.update(others)
            newest = max(others)
            send("other_run", steps=sorted(others), newest=newest, reason=(
                f"mirror {self.mirror.display}: the mirror prefix holds checkpoints of another "
                f"run (step {newest}, {runid.whose(others[newest])}; this run is "
                f"{runid.short(self.run_id)}): they are left as they are and do not count as this "
                "run's; this run's are uploaded beside them (a prefix per run keeps runs apart)"))
        return True

    def _upload(self, step: int) -> None:
        from rtrain.supervisor.mirror.store import CorruptLocal, MirrorError, OtherRun

        path = self.spec.ckpt_dir / f"checkpoint-{step}"
        try:
            t = self.mirror.upload(path, parallel=self.spec.parallel,
                                   resend=step in self.resend)
        except OtherRun as e:
            self.given_up[step] = str(e)
            send("refused", step=step, name=path.name, reason=e.reason)
            return
        except CorruptLocal as e:
            # Sending it again would not help: the newer or older ones go instead.
            self.given_up[step] = str(e)
            send("failed", step=step, reason=str(e), given_up=True)
            return
        except FileNotFoundError:
            return  # pruned locally meanwhile: the plan moves on to what is there now
        except MirrorError as e:
            self._failed(step, str(e))
            return
        assert self.remote is not None
        self.remote.add(step)
        self.resend.discard(step)
        self.failures = 0
        send("uploaded", step=step, bytes=t.bytes, seconds=round(t.seconds, 3), files=t.files)
        self._prune(step)

    def _failed(self, step: int | None, reason: str) -> None:
        self.failures += 1
        delay = retry_after(self.failures)
        self.retry_at = time.monotonic() + delay
        send("failed", step=step, reason=reason, retry_in_s=delay, failures=self.failures)

    def _mine(self, rc: Any) -> bool:
        """Retention plans for this run's checkpoints only; an unfinished upload is nobody's
        for sure, so it is left alone while another run's checkpoints share the prefix."""
        assert self.remote is not None
        return rc.step in self.remote if rc.committed else not self.others

    def _prune(self, just_sent: int) -> None:
        from rtrain.supervisor.mirror.prune_remote import prune_remote
        from rtrain.supervisor.mirror.store import MirrorError

        if self.spec.keep_remote == 0:
            return  # keep everything
        try:
            result = prune_remote(self.mirror, keep_remote=self.spec.keep_remote,
                                  milestone_every=self.spec.milestone_every,
                                  protect={just_sent}, key=self.key, mine=self._mine)
        except MirrorError as e:
            send("failed", step=None, reason=f"retention: {e}", retry_in_s=None, failures=0)
            return
        deleted = {r.step for r, _ in result.deleted}
        if deleted:
            assert self.remote is not None
            self.remote.difference_update(deleted)
            send("pruned", steps=sorted(deleted))

    def _final(self) -> int:
        newest = max(self._local(), default=None)
        made_it = newest is None or (self.remote is not None and newest in self.remote)
        if made_it:
            why = "uploaded" if newest is not None else "no checkpoint of this run to upload"
        elif newest in self.given_up:
            why = self.given_up[newest]
        elif self.remote is None or self.failures:
            why = "the mirror could not be reached"
        else:
            why = "not uploaded"
        send("final", step=newest, made_it=made_it, reason=why)
        return 0


def hold_lock(ckpt_dir: Path, commands: Commands) -> int | None:
    """The uploader lock's fd once held; None when told to finish while standing by."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    # Never through a link or a FIFO planted at the name (ownfiles): RefusedFile ends us.
    fd = ownfiles.open_own(ckpt_dir / LOCK_NAME, os.O_RDWR, create=True, mode=0o600).fd
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if not told:
                send("standby", reason="another rtrain uploads this checkpoint dir")
                told = True
            if commands.finishing:
                os.close(fd)
                return None
            commands.wait(STANDBY_RETRY_S)


def yield_to_training() -> None:
    """Lowest CPU and I/O priority: the uploader takes what training leaves (the training
    child and its data workers keep their share on a busy node), and an upload merely takes
    longer."""
    os.nice(10)
    try:
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_BE, value=7)
    except (OSError, AttributeError, ValueError):
        pass  # no I/O priorities here (not Linux, or a container without them)


def main(argv: list[str]) -> int:
    from rtrain.checkpoint.hashing import load_signing_key
    from rtrain.supervisor.core.errors import RtrainError
    from rtrain.supervisor.mirror.store import open_mirror

    spec = Spec.parse(argv[1])
    yield_to_training()
    commands = Commands()
    try:
        mirror = open_mirror(spec.url, file_mode=spec.file_mode,
                             timeouts=Timeouts(spec.connect_timeout_s, spec.read_timeout_s))
        key = load_signing_key()  # what rtrain itself loaded at launch, from the same env
    except RtrainError as e:
        send("failed", step=None, reason=str(e), retry_in_s=None, failures=1)
        return 2
    try:
        held = hold_lock(spec.ckpt_dir, commands)
    except ownfiles.RefusedFile as e:  # a link or a FIFO planted at the lock's name
        send("failed", step=None, reason=str(e), retry_in_s=None, failures=1)
        return 2
    if held is None:
        send("final", step=None, made_it=False, standby=True,
             reason="standing by: another rtrain uploads this checkpoint dir")
        return 0
    # Read once the lock is held: the launch settled it before starting this process.
    return Uploader(spec, mirror, commands, run=runid.read(spec.ckpt_dir), key=key).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
