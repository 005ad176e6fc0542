"""What a supervisor that died left running, found and ended by the next launch on the run dir.

PR_SET_PDEATHSIG takes the training child down with a SIGKILLed rtrain, but not the child's own
children: a `setsid` helper keeps running (and writing), a forked checkpoint writer may commit
into the run the next supervisor resumes. Before it starts anything, `rtrain launch` ends them.
Two records find them, because each alone misses some:

- `procs.json` in the run dir: the attempt's processes as the watch last sampled them, each
  with its kernel start time (a reused pid has another one and is never touched), and the host
  (a run dir on a shared filesystem may have been supervised from another machine);
- the environment: a process started below an attempt inherits RTRAIN_RUN_DIR (this run dir)
  and RTRAIN_GENERATION; a writer forked after the last sample is found this way. Only
  processes of our own user can be read; one that cleared its environment is found by the
  first record only.

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
from dataclasses import dataclass
from pathlib import Path

from supervisor import ownfiles
from supervisor.fsio import write_atomic
from supervisor.protocol import ENV_GENERATION, ENV_RUN_DIR

log = logging.getLogger(__name__)

PROCS_FILE = "procs.json"
PROCS_VERSION = 1
PROCS_MAX = 16 << 20  # bytes: some hundred thousand processes
CONFIRM_S = 2.0  # how long to wait for SIGKILLed leftovers to disappear


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str  # for the event and the message
    why: str  # "recorded" or "environment"


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


class ProcRecord:
    """Keeps `<run_dir>/procs.json` equal to the attempt's live processes (best effort: a full
    disk leaves the previous record, which still names the processes by start time)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / PROCS_FILE
        self._written: frozenset[tuple[int, int]] | None = None

    def update(self, pids: Iterable[int]) -> None:
        procs = frozenset((pid, t) for pid in pids if (t := start_time(pid)) is not None)
        if procs == self._written:
            return
        body = {"v": PROCS_VERSION, "host": socket.gethostname(),
                "supervisor": [os.getpid(), start_time(os.getpid())],
                "procs": sorted([pid, t] for pid, t in procs)}
        try:
            write_atomic(self.path, json.dumps(body) + "\n", durable=False)
        except OSError as e:
            log.debug("cannot record the process tree in %s: %s", self.path, e)
            return
        self._written = procs


def _recorded(run_dir: Path) -> dict[int, int]:
    """pid -> start time of the processes recorded. A file there that is not one rtrain may
    read (a link, a FIFO) is refused (RefusedFile: the launch stops, saying so); one that
    cannot be read or parsed records nothing."""
    try:
        raw = json.loads(ownfiles.read_own(Path(run_dir) / PROCS_FILE, limit=PROCS_MAX,
                                           what="process record"))
    except ownfiles.RefusedFile:
        raise
    except (OSError, ValueError, RecursionError):
        return {}
    if not isinstance(raw, dict) or raw.get("v") != PROCS_VERSION:
        return {}
    if raw.get("host") != socket.gethostname():
        return {}  # pids of another machine
    out = {}
    for item in raw.get("procs", ()):
        if (isinstance(item, list) and len(item) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
            out[item[0]] = item[1]
    return out


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


def _why(pid: int, recorded: dict[int, int], marker: bytes) -> str | None:
    if pid in recorded and recorded[pid] == start_time(pid):
        return "recorded"
    if _environ_marks(pid, marker):
        return "environment"
    return None


def end_leftovers(run_dir: Path) -> list[Leftover]:
    """SIGKILL what earlier supervisors of `run_dir` left running; return what was ended."""
    run_dir = Path(run_dir).resolve()
    marker = os.fsencode(str(run_dir))
    recorded = _recorded(run_dir)
    mine = _ancestors()
    ended: list[Leftover] = []
    fds: list[int] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in mine:
            continue
        pid = int(name)
        if _why(pid, recorded, marker) is None:
            continue
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        # Checked again once the pidfd pins the process: a pid reused in between fails the
        # check, or the signal goes to the (dead) process the pidfd names.
        why = _why(pid, recorded, marker)
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
    return ended


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
