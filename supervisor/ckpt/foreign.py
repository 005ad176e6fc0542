"""Checkpoints rtrain did not write, beside its own: listing, verification, resume selection.

A checkpoint directory may hold, besides rtrain's `checkpoint-<N>/` (with manifest.json):

- Hugging Face Trainer dirs, also named `checkpoint-<N>/`, told apart by trainer_state.json
  (and the other files only a Trainer writes) where rtrain's have manifest.json;
- Lightning `.ckpt` files (`epoch=3-step=400.ckpt`, `last.ckpt`);
- plain `torch.save` files (`*.pt`, `*.pth`, `*.bin`).

Loose files count only in a directory without checkpoint dirs: a Trainer's output dir also holds
the final `pytorch_model.bin` / `training_args.bin`, which are no place to resume from.

Order, newest first: a directory by the step in its name; a file by the step in its name
(`step=400`, `step_400`, `checkpoint-400.pt`, `ckpt400.pth`); a file without one sits just after
the newest step-named file not newer than it on disk (so `last.ckpt` written with
`epoch=3-step=400.ckpt` ranks above it), and among stepless files the higher step read from the
pickle (`pickle_scan.STEP_KEYS`: `iter_num`, `global_step`, ...), then the newer mtime, wins.
A step read from the pickle is the candidate's step (shown, and compared for progress), but it
never moves a file past step-named ones: `epoch` in one file and `step_400` in another's name
count different things.

rtrain's own checkpoints take the unchanged path (`verify.verify`); only a directory that turns
out to have no manifest is looked at again as a Trainer dir.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from pathlib import Path

from rtrain.checkpoint import safeio
from rtrain.checkpoint import verify as rverify
from rtrain.checkpoint.layout import MANIFEST, parse_step
from rtrain.checkpoint.verify import (
    Level,
    Selection,
    Status,
    Verdict,
    first_good,
    mark_quarantined,
)
from rtrain.supervisor.ckpt import hf_trainer, torchzip


class Format(str, enum.Enum):
    RTRAIN = "rtrain"
    HF_TRAINER = "hf-trainer"
    LIGHTNING = "lightning"
    TORCH = "torch"


FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
# Written beside checkpoints but never one to resume from.
_NOT_CHECKPOINTS = {"training_args.bin"}
_STEP_RES = (
    re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)", re.IGNORECASE),
    re.compile(r"(?:^|[^a-z])(?:checkpoint|ckpt|iter|iteration)[=_-]?(\d+)", re.IGNORECASE),
)


def step_from_name(name: str) -> int | None:
    """The training step a file name states (`epoch=3-step=400.ckpt` -> 400), if any."""
    stem = name.rsplit(".", 1)[0]
    for pattern in _STEP_RES:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


@dataclass(frozen=True)
class Candidate:
    path: Path
    step: int | None  # from the name, else from the pickle (a stepless file)
    is_dir: bool
    order: tuple[int, int, int, float]  # larger is newer


def list_candidates(ckpt_dir: str | os.PathLike, *, read_steps: bool = True) -> list[Candidate]:
    """Every checkpoint dir and, where there are none, every checkpoint file; newest first.
    `read_steps=False` leaves a stepless file's step unread (no pickle walk: the watch loop's
    look at the dir each sample), ordering such files by time alone."""
    root = Path(ckpt_dir)
    dirs, files = [], []
    try:
        entries = os.scandir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    with entries:
        for entry in entries:
            step = parse_step(entry.name)
            if step is not None:
                # Also a link or a file with a checkpoint dir's name: verification reports it.
                dirs.append(Candidate(root / entry.name, step, True, (step, 0, 0, 0.0)))
            elif _file_candidate(entry):
                # Not only regular files: a FIFO or a link leading out is listed, and refused
                # by _verify_file with the reason.
                files.append((entry.name, step_from_name(entry.name), _mtime(entry)))
    if dirs:
        dirs.sort(key=lambda c: c.order, reverse=True)
        return dirs
    stepped = sorted((mtime, step) for _, step, mtime in files if step is not None)
    out = []
    for name, step, mtime in files:
        if step is not None:
            out.append(Candidate(root / name, step, False, (step, 0, 0, mtime)))
        else:
            before = [s for t, s in stepped if t <= mtime]
            inner = content_step(root / name) if read_steps else None
            out.append(Candidate(root / name, inner, False,
                                 (max(before, default=-1), 1, -1 if inner is None else inner,
                                  mtime)))
    out.sort(key=lambda c: c.order, reverse=True)
    return out


def _file_candidate(entry: os.DirEntry) -> bool:
    return (entry.name.endswith(FILE_SUFFIXES) and not entry.name.startswith(".")
            and entry.name not in _NOT_CHECKPOINTS and not entry.is_dir())


def resume_entries(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Every entry of the dir a resume pick could ever consider: the checkpoint dirs and the
    checkpoint files (`list_candidates` shows the files only where there are no dirs; with
    the dirs gone, the files would be next). Names only: nothing is read or verified."""
    root = Path(ckpt_dir)
    try:
        with os.scandir(root) as entries:
            return sorted(root / e.name for e in entries
                          if parse_step(e.name) is not None or _file_candidate(e))
    except (FileNotFoundError, NotADirectoryError):
        return []


def content_step(path: Path) -> int | None:
    """The step a stepless file's pickle holds; None when it holds none or does not verify
    (verification says why, later)."""
    try:
        if path.is_symlink() or not path.is_file():
            return None  # a link is resolved, and a FIFO refused, by verification only
        return torchzip.inspect(path, full=False).step
    except (OSError, ValueError):
        return None


def _mtime(entry: os.DirEntry) -> float:
    try:
        return entry.stat().st_mtime
    except OSError:  # a dangling link
        return entry.stat(follow_symlinks=False).st_mtime


def _verify_file(path: Path, level: Level, step: int | None) -> Verdict:
    fmt = Format.LIGHTNING if path.suffix == ".ckpt" else Format.TORCH
    info: dict = {"step": step}
    try:
        # A link is followed only inside the directory (Lightning's `last.ckpt` may be one).
        member = rverify.check_member_name(path.parent, path.name)
        info["created"] = os.stat(member).st_mtime
        checked = torchzip.inspect(member, full=level is Level.FULL)
        note = checked.note
        if step is None and checked.step is not None:
            step = checked.step
            info.update(step=step, step_from=f"{checked.step_key} in the pickle")
    except FileNotFoundError:
        return Verdict(path, -1 if step is None else step, Status.INCOMPLETE, "file is gone",
                       format=fmt.value, info=info)
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        if isinstance(e, safeio.UnsafeFile):
            why = f"the file {why}"
        return Verdict(path, -1 if step is None else step, Status.CORRUPT, why,
                       format=fmt.value, info=info)
    if note:
        info["note"] = note
    return Verdict(path, -1 if step is None else step, Status.OK, "", format=fmt.value,
                   info=info)


def _verify_hf(path: Path, level: Level) -> Verdict:
    dir_step = parse_step(path.name)
    report = hf_trainer.check(path, full=level is Level.FULL, dir_step=dir_step)
    step = report.step if report.step is not None else (-1 if dir_step is None else dir_step)
    status = (Status.OK if not report.problem
              else Status.INCOMPLETE if report.incomplete else Status.CORRUPT)
    return Verdict(path, step, status, report.problem, format=Format.HF_TRAINER.value,
                   info=report.info)


def is_hf_dir(path: Path) -> bool:
    return not (path / MANIFEST).exists() and hf_trainer.looks_like(path)


def verify_path(path: str | os.PathLike, level: Level | str = Level.FULL,
                key: bytes | None = None) -> Verdict:
    """One checkpoint of any format: a directory (rtrain's or a Trainer's) or a file."""
    path, level = Path(path), Level(level)
    # A checkpoint file (a FIFO or link with such a name too: refused there with the reason),
    # or any regular file; everything else is a directory, whose manifest.load refuses links.
    if (path.suffix in FILE_SUFFIXES and not path.is_dir()) or (
            path.is_file() and not path.is_symlink()):
        return _verify_file(path, level, step_from_name(path.name))
    verdict = rverify.verify(path, level, key)
    if verdict.status is Status.INCOMPLETE and is_hf_dir(path):
        return _verify_hf(path, level)
    return verdict


def verify_candidate(c: Candidate, level: Level | str, key: bytes | None = None) -> Verdict:
    if c.is_dir:
        return verify_path(c.path, level, key)
    # The name's step, not c.step: one read from the pickle is read again with the verdict.
    return _verify_file(c.path, Level(level), step_from_name(c.path.name))


def verify_all(ckpt_dir: str | os.PathLike, level: Level | str = Level.QUICK,
               key: bytes | None = None) -> list[Verdict]:
    """Every checkpoint of any format, newest first."""
    return list(mark_quarantined(ckpt_dir, (verify_candidate(c, level, key)
                                            for c in list_candidates(ckpt_dir))))


def select_resume_any_format(
    ckpt_dir: str | os.PathLike,
    level: Level | str = Level.FULL,
    key: bytes | None = None,
    skip_newest: int = 0,
    on_skip: Callable[[Verdict], None] | None = None,
    exclude: Collection[str] = (),
    key_problem: Callable[[Verdict], str | None] | None = None,
) -> Selection:
    """The checkpoint a launch resumes from, over checkpoints of every format: the newest that
    verifies and is not quarantined, each newer one that fails reported. `exclude` holds the
    `resume_identity` of checkpoints a worker of the run could not load (History.bad_checkpoints);
    they are passed over without a report (one was made when that happened). `key_problem`
    says why this run's key cannot open a checkpoint that verifies (`crypt.key_problem`): such
    a one is skipped and reported like a failed one, status WRONG_KEY (the launch decides
    whether that may end in an older pick: `launch/resume.py`).

    `rtrain launch` and `rtrain status` both call this, so status names the checkpoint a launch
    would pick. (`verify.select_rtrain_resume` is the worker's own, over rtrain's format only.)
    """
    verdicts = mark_quarantined(ckpt_dir, (verify_candidate(c, level, key)
                                           for c in list_candidates(ckpt_dir)))
    if exclude:
        bad = set(exclude)
        verdicts = (v for v in verdicts if not (v.ok and resume_identity(v) in bad))
    if key_problem is not None:
        verdicts = (_locked(v, key_problem) for v in verdicts)
    return first_good(verdicts, skip_newest, on_skip)


def _locked(v: Verdict, key_problem: Callable[[Verdict], str | None]) -> Verdict:
    why = key_problem(v) if v.ok else None
    return v if why is None else replace(v, status=Status.WRONG_KEY, reason=why)


def resume_identity(v: Verdict) -> str:
    """A checkpoint as a run remembers it: the path and when it was made (a checkpoint saved
    again at the same path is a different one)."""
    created = (v.manifest or {}).get("created")
    if created is None:
        try:
            created = os.stat(v.path).st_mtime_ns
        except OSError:
            created = None
    return f"{v.path.resolve()}|{created}"
