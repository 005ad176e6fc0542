"""An earlier run's checkpoints set aside when a run starts over in their directory.

`rtrain launch --resume never` starts a new run from nothing. When the checkpoint dir still
holds an earlier run's checkpoints, the new run must own only its own from then on: otherwise
its first relaunch resumes the earlier run's newest (a higher step than anything it wrote),
and its retention, which keeps the newest steps, deletes its own checkpoints right after
saving them to keep the earlier run's. So, before its first attempt, every entry a resume pick
could consider (checkpoint dirs of any format and checkpoint files: `foreign.resume_entries`)
is moved into `<ckpt-dir>/.earlier-run-<UTC time>/`: one rename each, in the same directory
(so the same filesystem: nothing copied, nothing deleted), with `NOTE.txt` saying what they
are and how to put them back. Nothing reads a hidden entry as a checkpoint (resume, retention,
`prune`, `inspect`, `status`, the mirror's uploader), so everything that reads the dir sees the
new run's checkpoints alone, whatever the format.

Left in place: what is not a checkpoint (`quarantine.json`, `.rtrain-generation`, temp and
trash dirs of saves, other files). An entry gone before its rename (another node's rtrain
moved it first) is passed over.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from rtrain.checkpoint.layout import EARLIER_PREFIX
from rtrain.supervisor.ckpt import foreign
from rtrain.supervisor.core import filemode

NOTE = "NOTE.txt"


@dataclass(frozen=True)
class SetAside:
    path: Path
    """The directory they were moved into."""
    names: tuple[str, ...]
    """The entries moved, as they were named in the checkpoint dir."""


def set_aside(ckpt_dir: Path, now: float, *, file_mode: int = filemode.DEFAULT_FILE_MODE,
              why: str = "a new run started over here (rtrain launch --resume never)"
              ) -> SetAside | None:
    """Move the dir's checkpoints into a new `.earlier-run-<time>/`; None when it held none.
    An OSError (a read-only dir, no room for the new dir) is raised after the note names what
    was moved before it."""
    ckpt_dir = Path(ckpt_dir)
    entries = foreign.resume_entries(ckpt_dir)
    if not entries:
        return None
    dest = _new_dir(ckpt_dir, now, file_mode)
    moved: list[str] = []
    try:
        for path in entries:
            try:
                os.rename(path, dest / path.name)
            except FileNotFoundError:
                continue
            moved.append(path.name)
    finally:
        if moved:
            _note(dest, now, why, moved, file_mode)
        else:
            _remove_empty(dest)
    _fsync_dir(ckpt_dir)
    return SetAside(dest, tuple(moved)) if moved else None


def _new_dir(ckpt_dir: Path, now: float, file_mode: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    for n in range(1000):
        dest = ckpt_dir / f"{EARLIER_PREFIX}{stamp}{f'-{n}' if n else ''}"
        try:
            os.mkdir(dest, filemode.dir_mode(file_mode))
        except FileExistsError:
            continue
        filemode.set_mode(dest, filemode.dir_mode(file_mode))  # past the umask
        return dest
    raise FileExistsError(f"no free name for {EARLIER_PREFIX}{stamp} in {ckpt_dir}")


def _note(dest: Path, now: float, why: str, moved: list[str], file_mode: int) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    text = (f"These checkpoints were in {dest.parent} when {why}, at {when}.\n"
            "rtrain moved them here so that the new run resumes only from its own checkpoints\n"
            "(its resume picks, retention, prune and mirror uploads never look in here).\n"
            "Nothing was deleted. To resume from one of them, move it back, or pass its path:\n"
            "rtrain launch --resume <path> ...\n\n"
            + "".join(f"{name}\n" for name in moved))
    try:
        fd = os.open(dest / NOTE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                     file_mode)
    except OSError:
        return  # the note is a courtesy; the event and the launch's line say the same
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _remove_empty(dest: Path) -> None:
    try:
        os.rmdir(dest)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
