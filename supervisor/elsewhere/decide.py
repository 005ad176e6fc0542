"""Checkpoints written where rtrain does not look: the warning that resume cannot work.

A run that is handed the checkpoint to resume from (`--resume-arg`, `{checkpoint}` in the
command) gets nothing from rtrain when the script writes its checkpoints elsewhere: every
relaunch is fresh and no failure ever counts as progress. The rule:

    warn  when  the run expects checkpoints in the watched dir (`--resume-arg` / `{checkpoint}`;
                a script without either may resume by itself, and may write weights it
                downloaded or exports that are no checkpoint: no guess is made for it)
          and   that dir still holds none after `after_s` seconds of training (this launch's
                attempts together)
          and   the script wrote checkpoint-like files elsewhere under its working dir since
                its first attempt of this launch started (`Written`, found by the bounded scan
                in elsewhere/scan.py)

The warning names the files seen and the `--ckpt-dir` to pass: the directory holding the newest
of them (a Trainer's `checkpoint-N/` counts as one entry, its parent is the dir to watch).
`after_s` 0 turns it off. Pure: the caller scans, counts the seconds and acts.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass

SHOWN = 3  # files named in the message; the event carries them all


@dataclass(frozen=True, kw_only=True, slots=True)
class Written:
    """One checkpoint-like entry the script wrote outside the watched dir."""

    path: str
    """Relative to the script's working dir, '/'-separated (`out/ckpt.pt`)."""
    mtime: float
    is_dir: bool = False
    """A Trainer-style `checkpoint-N/` dir."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Seen:
    """What the launch saw of the run so far."""

    expects: bool
    """The run resumes from checkpoints rtrain finds: `--resume-arg` or `{checkpoint}` given."""
    watched: str
    """The watched checkpoint dir as the person gave it (relative to the working dir when
    inside it)."""
    watched_empty: bool
    """It holds no checkpoint of any format."""
    trained_s: float
    """Seconds this launch's attempts have run."""
    written: tuple[Written, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Elsewhere:
    """The warning: what to record and say."""

    files: tuple[str, ...]
    """Every entry seen, newest first."""
    ckpt_dir: str
    """The `--ckpt-dir` to pass."""
    trained_s: float
    message: str


def judge(seen: Seen, after_s: float) -> Elsewhere | None:
    """The warning, or None while there is nothing to say (see the module docstring)."""
    if after_s <= 0 or not seen.expects or not seen.watched_empty or not seen.written:
        return None
    if seen.trained_s < after_s:
        return None
    newest = sorted(seen.written, key=lambda w: (-w.mtime, w.path))
    files = tuple(w.path for w in newest)
    where = posixpath.dirname(files[0].rstrip("/")) or "."
    shown = ", ".join(files[:SHOWN]) + (f" and {len(files) - SHOWN} more"
                                         if len(files) > SHOWN else "")
    message = (f"rtrain watches {seen.watched}, which is still empty after "
               f"{minutes(seen.trained_s)} of training, while the script wrote {shown}: "
               f"pass --ckpt-dir {where} (until then each relaunch starts fresh)")
    return Elsewhere(files=files, ckpt_dir=where, trained_s=seen.trained_s, message=message)


def short(warning: Elsewhere) -> str:
    """The reminder on a later launch line: why it is fresh again."""
    return (f"nothing to resume from: the script writes {warning.files[0]}; "
            f"pass --ckpt-dir {warning.ckpt_dir}")


def minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"
