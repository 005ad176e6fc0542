"""What a supervisor that died left running, found and ended by the next launch on the run dir.

PR_SET_PDEATHSIG takes the training child down with a SIGKILLed rtrain, but not the child's own
children: a `setsid` helper keeps running (and writing), a forked checkpoint writer may commit
into the run the next supervisor resumes. Before it starts anything, `rtrain launch` ends them.
A process is ended only when something no one else can forge says an rtrain of this run
started it; two such marks find them, because each alone misses some:

- `procs.json` in the run dir: the attempt's processes as the watch last sampled them, each
  with its kernel start time (a reused pid has another one and is never touched), the host and
  the boot (a run dir on a shared filesystem may have been supervised from another machine),
  signed with an HMAC under this user's own key (userkey.py), over the run dir's path too. The
  run dir may be writable by a group and pids and start times are public, so an unsigned or
  forged record ends nothing: a process it names that carries no mark of its own is left
  running, and the launch says which and why (`leftovers_skipped`);
- the environment: a process started below an attempt inherits RTRAIN_RUN_DIR (this run dir)
  and RTRAIN_GENERATION; a writer forked after the last sample is found this way. Only a
  process of our own user can be read, and no one else can put these into its environment.

What is covered: every process the last sample saw (while the user's key is there), and every
later one that kept its environment. Not covered: a process that both cleared its environment
(`env -i`, a daemon) and started after the last 1 s sample of a SIGKILLed rtrain, and, without
the key, any process that cleared its environment.

This process and its ancestors are never candidates. Each is signalled through a pidfd opened
before its identity is checked, so a pid reused in between cannot be hit.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import write_atomic
from rtrain.supervisor.core.protocol import ENV_GENERATION, ENV_RUN_DIR
from rtrain.supervisor.proc import userkey

log = logging.getLogger(__name__)

PROCS_FILE = "procs.json"
PROCS_VERSION = 2  # 2: signed (mac), with the boot id; 1 (older rtrain): unsigned
PROCS_MAX = 16 << 20  # bytes: some hundred thousand processes
CONFIRM_S = 2.0  # how long to wait for SIGKILLed leftovers to disappear


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str  # for the event and the message
    why: str  # "recorded" or "environment"


@dataclass(frozen=True)
class Skipped:
    """A live process procs.json names that nothing proves an rtrain of this run started."""

    pid: int
    command: str
    reason: str  # the sentence the user reads


@dataclass(frozen=True)
class Swept:
    ended: list[Leftover] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (IndexError, ValueError):
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _signed_part(body: dict[str, Any], run_dir: Path) -> bytes:
    """What the HMAC covers: the record without its mac, and the run dir it is for (a record
    copied from another run dir of the same user does not verify here)."""
    part = {k: v for k, v in body.items() if k != "mac"}
    part["run_dir"] = str(run_dir)
    return json.dumps(part, sort_keys=True, separators=(",", ":")).encode()


class ProcRecord:
    """Keeps `<run_dir>/procs.json` equal to the attempt's live processes (best effort: a full
    disk leaves the previous record, which still names the processes by start time)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir).resolve()
        self.path = self.run_dir / PROCS_FILE
        self._written: frozenset[tuple[int, int]] | None = None
        self._key, no_key = userkey.load(create=True)
        if self._key is None:
            log.info("procs.json is written unsigned (%s): if this rtrain is killed, the next "
                     "launch ends only the processes whose environment names the run", no_key)

    def update(self, pids: Iterable[int]) -> None:
        procs = frozenset((pid, t) for pid in pids if (t := start_time(pid)) is not None)
        if procs == self._written:
            return
        body: dict[str, Any] = {
            "v": PROCS_VERSION, "host": socket.gethostname(), "boot": boot_id(),
            "supervisor": [os.getpid(), start_time(os.getpid())],
            "procs": sorted([pid, t] for pid, t in procs)}
        if self._key is not None:
            body["mac"] = userkey.sign(self._key, _signed_part(body, self.run_dir))
        try:
            write_atomic(self.path, json.dumps(body) + "\n", durable=False)
        except OSError as e:
            log.debug("cannot record the process tree in %s: %s", self.path, e)
            return
        self._written = procs


@dataclass(frozen=True)
class _Record:
    """procs.json as read: the processes it names, and whether it may be believed."""

    procs: dict[int, int]  # pid -> start time
    distrust: str | None = None  # why its names prove nothing; None: signed and verified


def _recorded(run_dir: Path) -> _Record:
    """The processes recorded. A file there that is not one rtrain may read (a link, a FIFO)
    is refused (RefusedFile: the launch stops, saying so); one that cannot be read or parsed
    records nothing."""
    try:
        raw = json.loads(ownfiles.read_own(Path(run_dir) / PROCS_FILE, limit=PROCS_MAX,
                                           what="process record"))
    except ownfiles.RefusedFile:
        raise
    except (OSError, ValueError, RecursionError):
        return _Record({})
    if not isinstance(raw, dict) or raw.get("v") not in (1, PROCS_VERSION):
        return _Record({})
    if raw.get("host") != socket.gethostname():
        return _Record({})  # pids of another machine
    if raw.get("v") == PROCS_VERSION and raw.get("boot") != boot_id():
        return _Record({})  # pids of an earlier boot
    procs = {}
    for item in raw.get("procs", ()):
        if (isinstance(item, list) and len(item) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            procs[item[0]] = item[1]
    if raw.get("v") != PROCS_VERSION or "mac" not in raw:
        return _Record(procs, "procs.json is not signed (written by an older rtrain, by one "
                              "that had no key, or by someone else)")
    key, no_key = userkey.load(create=False)
    if key is None:
        return _Record(procs, f"procs.json's signature cannot be checked ({no_key})")
    if not userkey.verify(key, _signed_part(raw, run_dir), raw["mac"]):
        return _Record(procs, "procs.json's signature does not match: an rtrain of this user "
                              "did not write it for this run dir")
    return _Record(procs)


def _environ_marks(pid: int, run_dir: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False
    return (ENV_RUN_DIR.encode() + b"=" + run_dir in env
            and any(e.startswith(ENV_GENERATION.encode() + b"=") and len(e) > 20 for e in env))


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            pid = int(stat[stat.rfind(b")") + 2:].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def _why(pid: int, record: _Record, marker: bytes) -> str | None:
    if record.distrust is None and pid in record.procs and record.procs[pid] == start_time(pid):
        return "recorded"
    if _environ_marks(pid, marker):
        return "environment"
    return None


def _named(pid: int, record: _Record) -> bool:
    """procs.json names this very process (same pid, same start time)."""
    return pid in record.procs and record.procs[pid] == start_time(pid)


def end_leftovers(run_dir: Path) -> Swept:
    """SIGKILL what earlier supervisors of `run_dir` left running: what was ended, and the live
    processes procs.json names that were left alone (with why)."""
    run_dir = Path(run_dir).resolve()
    marker = os.fsencode(str(run_dir))
    record = _recorded(run_dir)
    mine = _ancestors()
    ended: list[Leftover] = []
    skipped: list[Skipped] = []
    fds: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in mine:
            if _named(pid, record):
                skipped.append(Skipped(pid, _command(pid), "it is this rtrain or one of the "
                                                           "processes that started it"))
            continue
        if _why(pid, record, marker) is None:
            if _named(pid, record):
                skipped.append(Skipped(pid, _command(pid), f"{record.distrust}, and its "
                                                           "environment does not name the run"))
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        # Checked again once the pidfd pins the process: a pid reused in between fails the
        # check, or the signal goes to the (dead) process the pidfd names.
        why = _why(pid, record, marker)
        command = _command(pid)
        try:
            if why is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:  # exited meanwhile
            why = None
        if why is None:
            os.close(fd)
            continue
        ended.append(Leftover(pid, command, why))
        fds.append(fd)
    _wait_gone(fds, CONFIRM_S)
    return Swept(ended, skipped)


def _wait_gone(fds: list[int], timeout: float) -> None:
    """Wait until every pidfd says its process exited (bounded), then close them."""
    try:
        poll = select.poll()
        for fd in fds:
            poll.register(fd, select.POLLIN)
        left = set(fds)
        deadline = time.monotonic() + timeout
        while left and (wait := deadline - time.monotonic()) > 0:
            for fd, _ in poll.poll(wait * 1000):
                left.discard(fd)
                poll.unregister(fd)
    finally:
        for fd in fds:
            os.close(fd)
