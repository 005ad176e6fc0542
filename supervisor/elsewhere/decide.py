"""Never a silent restart from scratch: why rtrain has nothing to resume this script from.

The first time a launch relaunches a failed attempt with no checkpoint in the watched dir, rtrain
says so once (a line, a `cannot_resume` event, `rtrain status`), with the first reason that
holds:

    elsewhere        the run hands the script its checkpoint (`--resume-arg` / `{checkpoint}`)
                     and the script wrote checkpoint-like files outside the watched dir since
                     the launch's first attempt started (`Written`, elsewhere/scan.py): they
                     are named, with the `--ckpt-dir` to pass (the dir of the newest; a
                     Trainer's `checkpoint-N/` counts as one entry, its parent is the dir).
                     A script not handed a checkpoint is not judged on what it writes
                     elsewhere: that may be weights it downloaded, or exports.
    no_handoff       nothing would give the script a checkpoint: no `--resume-arg`, no
                     `{checkpoint}`, and no heartbeat of the worker library (whose
                     Checkpointer reads RTRAIN_RESUME_FROM).
    not_checkpoints  the watched dir holds files, none of them a checkpoint: they are named.
    empty            the watched dir holds nothing: the script ended before its first save.

Said as the first fresh relaunch starts, not after minutes of training. Pure: the caller lists
the dir, scans and records.
"""

from __future__ import annotations

import enum
import posixpath
from dataclasses import dataclass

SHOWN = 3  # files named in the message; the event carries them all


class Reason(str, enum.Enum):
    ELSEWHERE = "elsewhere"
    NO_HANDOFF = "no_handoff"
    NOT_CHECKPOINTS = "not_checkpoints"
    EMPTY = "empty"


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
    """What the launch saw when an attempt ended."""

    hands: bool
    """The run hands the script its checkpoint: `--resume-arg` or `{checkpoint}` given."""
    worker: bool
    """The script sent heartbeats: it uses the worker library, which resumes by itself."""
    watched: str
    """The watched checkpoint dir as the person gave it (relative to the working dir when
    inside it)."""
    resumable: bool
    """It holds a checkpoint of some format."""
    present: tuple[str, ...] = ()
    """What it holds that is not a checkpoint (a dir's name ends in '/'), sorted."""
    written: tuple[Written, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class CannotResume:
    """What to record and say."""

    reason: Reason
    files: tuple[str, ...]
    """The files the message is about: written elsewhere (newest first) or present."""
    ckpt_dir: str | None
    """The `--ckpt-dir` to pass (`elsewhere` only)."""
    message: str


def _listed(files: tuple[str, ...]) -> str:
    more = len(files) - SHOWN
    return ", ".join(files[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def judge(seen: Seen) -> CannotResume | None:
    """The notice, or None when there is a checkpoint to resume from (module docstring)."""
    if seen.resumable:
        return None
    head = f"rtrain cannot resume this script: {seen.watched} holds no checkpoint"
    fresh = "each relaunch starts fresh"
    if seen.hands and seen.written:
        newest = sorted(seen.written, key=lambda w: (-w.mtime, w.path))
        files = tuple(w.path for w in newest)
        where = posixpath.dirname(files[0].rstrip("/")) or "."
        return CannotResume(
            reason=Reason.ELSEWHERE, files=files, ckpt_dir=where,
            message=f"{head}, while the script wrote {_listed(files)}: pass --ckpt-dir "
                    f"{where} (until then {fresh})")
    if not seen.hands and not seen.worker:
        return CannotResume(
            reason=Reason.NO_HANDOFF, files=seen.present, ckpt_dir=None,
            message=f"{head}, and nothing hands one to the script (no --resume-arg, no "
                    f"{{checkpoint}} in its arguments, no rtrain.Checkpointer): {fresh}; "
                    "pass --resume-arg with the script's resume option and --ckpt-dir where "
                    "it saves")
    if seen.present:
        return CannotResume(
            reason=Reason.NOT_CHECKPOINTS, files=seen.present, ckpt_dir=None,
            message=f"{head}, only {_listed(seen.present)}, which rtrain does not recognise "
                    f"as checkpoints: {fresh} until the script saves one there (pass "
                    "--ckpt-dir where it saves)")
    # Most often a script that saves, failing before its first save: not yet, rather than not.
    return CannotResume(
        reason=Reason.EMPTY, files=(), ckpt_dir=None,
        message=f"nothing to resume from yet: {seen.watched} holds no checkpoint (the script "
                f"ended before it saved one there): {fresh} until it does (if it saves "
                "elsewhere, pass that --ckpt-dir)")


def short(notice: CannotResume) -> str:
    """The reminder on a later launch line: why it is fresh again."""
    if notice.reason is Reason.ELSEWHERE:
        return (f"nothing to resume from: the script writes {notice.files[0]}; "
                f"pass --ckpt-dir {notice.ckpt_dir}")
    if notice.reason is Reason.NO_HANDOFF:
        return "nothing to resume from: the script takes no checkpoint from rtrain"
    return "nothing to resume from: no checkpoint in the checkpoint dir yet"
