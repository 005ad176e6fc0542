"""Names on disk (contract 3) and listing a checkpoint directory.

<ckpt-dir>/checkpoint-<step>/                  committed (renamed into place when complete)
<ckpt-dir>/.tmp-checkpoint-<step>-<host>-<pid>-<token>/   being written
<ckpt-dir>/.trash-checkpoint-<step>-<token>/   being deleted (renamed out of the way first)
<ckpt-dir>/.earlier-run-<time>/                an earlier run's checkpoints, set aside when a
                                               run started over (`--resume never`)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from rtrain.supervisor.core.pid_alive import pid_alive

CKPT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-checkpoint-"
TRASH_PREFIX = ".trash-checkpoint-"
# An earlier run's checkpoints, set aside (supervisor/ckpt/setaside.py).
EARLIER_PREFIX = ".earlier-run-"
MANIFEST = "manifest.json"

# No leading zeros: "checkpoint-0100" would share step 100 with "checkpoint-100", and prune,
# which keys checkpoints by step, could then delete the one it meant to keep.
_CKPT_RE = re.compile(r"^checkpoint-(0|[1-9]\d*)$")
_TMP_RE = re.compile(r"^\.tmp-checkpoint-(\d+)-(.+)-(\d+)-([0-9a-f]+)$")


def checkpoint_name(step: int) -> str:
    return f"{CKPT_PREFIX}{step}"


def parse_step(name: str) -> int | None:
    m = _CKPT_RE.match(name)
    return int(m.group(1)) if m else None


def host_name() -> str:
    """This host as temp dir names spell it."""
    # Dashes separate the fields of a temp name, so keep the host name free of them.
    # os.uname() rather than socket.gethostname(): the same name, without importing socket
    # (this module is on `rtrain inspect`'s start-up path).
    return os.uname().nodename.replace("-", "_") or "host"


_host = host_name


def tmp_name(step: int) -> str:
    return f"{TMP_PREFIX}{step}-{_host()}-{os.getpid()}-{os.urandom(4).hex()}"


def trash_name(name: str) -> str:
    return f"{TRASH_PREFIX}{name.removeprefix(CKPT_PREFIX)}-{os.urandom(4).hex()}"


@dataclass(frozen=True)
class TempDir:
    path: Path
    step: int | None
    host: str | None
    pid: int | None

    def writer_alive(self) -> bool:
        """Whether the process that is writing this temp dir may still be running.

        A writer on another host cannot be checked from here: it counts as alive so that prune
        never pulls a directory from under a save in flight on a shared filesystem.
        """
        if self.pid is None or self.host is None:
            return False
        if self.host != _host():
            return True
        if self.pid == os.getpid():
            return True  # ours: the Checkpointer decides about its own temp dirs
        return pid_alive(self.pid)


def list_checkpoints(ckpt_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Committed checkpoint dirs as (step, path), newest first. A missing dir is empty.

    Every entry with a checkpoint's name is listed, also one that is not a directory (a link, a
    file, a FIFO): verification reports it as corrupt with the reason rather than skipping it
    unseen, and nothing follows it (`manifest.load` refuses it).
    """
    root = Path(ckpt_dir)
    found = [(step, root / name) for name in _names(root)
             if (step := parse_step(name)) is not None]
    found.sort(key=lambda sp: sp[0], reverse=True)
    return found


def list_leftovers(ckpt_dir: str | os.PathLike) -> list[TempDir]:
    """Temp dirs of saves (finished or not) and trash dirs of interrupted deletions."""
    root = Path(ckpt_dir)
    out = []
    for name in _names(root):
        if name.startswith(TMP_PREFIX):
            m = _TMP_RE.match(name)
            if m:
                out.append(TempDir(root / name, int(m.group(1)), m.group(2), int(m.group(3))))
            else:
                out.append(TempDir(root / name, None, None, None))
        elif name.startswith(TRASH_PREFIX):
            out.append(TempDir(root / name, None, None, None))
    return out


def _names(root: Path) -> list[str]:
    """The names in `root`; a missing directory is empty (nothing saved there yet)."""
    try:
        with os.scandir(root) as entries:
            return [entry.name for entry in entries]
    except FileNotFoundError:
        return []
