"""Checkpoints rtrain did not write, beside its own: listing, verification, resume selection.

A checkpoint directory may hold, besides rtrain's `checkpoint-<N>/` (with manifest.json):

- Hugging Face Trainer dirs, also named `checkpoint-<N>/`, told apart by trainer_state.json
  (and the other files only a Trainer writes) where rtrain's have manifest.json;
- the save dirs of accelerate (`step_N/`, `epoch_N/`, `checkpoint_N/`), DeepSpeed
  (`global_stepN/`, with `latest`) and DCP (`step-N/` with `.metadata`): `layouts.py`, each
  verified as a whole, the files in it never candidates of their own;
- Lightning `.ckpt` files (`epoch=3-step=400.ckpt`, `last.ckpt`);
- `torch.save` files by content: any name whose bytes are torch.save's (`says_torch_save`:
  `checkpoint.pth.tar`, `weights.tar`, no suffix), and every `.pt`, `.pth`, `.bin`, `.pth.tar`
  (listed whatever their bytes, so a damaged one is shown with its reason).

One save is one candidate: a link to a listed file (Composer's `latest-rank0.pt`) and a hard
link of one (timm's `last.pth.tar` beside `checkpoint-N.pth.tar`) are the same save. Never
candidates: "best" copies (`model_best.pth.tar`: an export of the best metric, older than the
newest save), saves in progress (`tmp.pth.tar`), names starting with `.`, `training_args.bin`.
Resume takes the newest verified training state.

Loose files count only in a directory without checkpoint dirs: a Trainer's output dir also holds
the final `pytorch_model.bin` / `training_args.bin`, which are no place to resume from.

Order, newest first: a directory by the step in its name; a file by the step in its name
(`step=400`, `step_400`, `checkpoint-400.pt`, `ckpt400.pth`, Composer's `ep0-ba400`, a
trailing `-400`); a file without one sits just after
the newest step-named file not newer than it on disk (so `last.ckpt` written with
`epoch=3-step=400.ckpt` ranks above it), and among stepless files the higher step read from the
pickle (`pickle_scan.STEP_KEYS`: `iter_num`, `global_step`, ...), then the newer mtime, wins.
A step read from the pickle is the candidate's step (shown, and compared for progress), but it
never moves a file past step-named ones: `epoch` in one file and `step_400` in another's name
count different things.

rtrain's own checkpoints take the unchanged path (`verify.verify`); only a directory that turns
out to have no manifest is looked at again as another library's save.
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
from rtrain.supervisor.ckpt import hf_trainer, layouts, torchzip


class Format(str, enum.Enum):
    RTRAIN = "rtrain"
    HF_TRAINER = "hf-trainer"
    LIGHTNING = "lightning"
    TORCH = "torch"
    ACCELERATE = layouts.Layout.ACCELERATE.value
    DEEPSPEED = layouts.Layout.DEEPSPEED.value
    DCP = layouts.Layout.DCP.value


# Listed whatever their bytes (a damaged one is shown, with the reason, not passed over);
# a file of any other name is a candidate when its bytes say torch.save (`says_torch_save`).
FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pth.tar")
# Written beside checkpoints but never one to resume from.
_NOT_CHECKPOINTS = {"training_args.bin"}
_STRIP_SUFFIXES = (".tar", ".pth", ".pt", ".ckpt", ".bin", ".pkl")
_STEP_RES = (
    re.compile(r"(?:^|[^a-z])step[=_-]?(\d+)", re.IGNORECASE),
    re.compile(r"(?:^|[^a-z])(?:checkpoint|ckpt|iter|iteration)[=_-]?(\d+)", re.IGNORECASE),
    re.compile(r"(?:^|[^a-z])ba(\d+)(?:$|[^a-z0-9])", re.IGNORECASE),  # Composer's ep0-ba40
    re.compile(r"-(\d+)$"),  # model-1000.pt, timm's checkpoint-3.pth.tar
)
# A "best" copy (imagenet's model_best.pth.tar, `best.pt`) is an export of the best metric so
# far, not a training state to resume: it is older than the newest save and resuming from it
# would train the same steps again.
_BEST = re.compile(r"(?:^|[_\-.])best(?:$|[_\-.])", re.IGNORECASE)
# A save in progress (timm writes tmp.pth.tar, then renames it to last.pth.tar).
_TEMP = re.compile(r"^te?mp(?:$|[_\-.])", re.IGNORECASE)
# Composer writes one file per rank; rank 0's stands for the save.
_OTHER_RANK = re.compile(r"-rank[1-9]\d*$")
# torch.save's zip starts with the local header of `<name>/data.pkl`; a legacy file with the
# pickle of torch's magic number at protocol 2.
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."
_sniffed: dict[tuple, bool] = {}


def _stem(name: str) -> str:
    """The name without its checkpoint suffixes (`checkpoint-3.pth.tar` -> `checkpoint-3`)."""
    stem = name
    while stem.lower().endswith(_STRIP_SUFFIXES):
        stem = stem.rsplit(".", 1)[0]
    return stem


def step_from_name(name: str) -> int | None:
    """The training step a file name states (`epoch=3-step=400.ckpt` -> 400), if any."""
    stem = _stem(name)
    for pattern in _STEP_RES:
        m = pattern.search(stem)
        if m:
            return int(m.group(1))
    return None


def is_best_copy(name: str) -> bool:
    """`model_best.pth.tar`, `best.pt`: a copy of the best save, never a resume point (a name
    that states a step, `best-step=400.ckpt`, is a save of its own)."""
    return bool(_BEST.search(_stem(name))) and step_from_name(name) is None


def _dir_step(name: str) -> int | None:
    step = parse_step(name)
    return step if step is not None else layouts.dir_step(name)


@dataclass(frozen=True)
class Candidate:
    path: Path
    step: int | None  # from the name, else from the pickle (a stepless file)
    is_dir: bool
    order: tuple[int, int, int, float]  # larger is newer
    refused: str = ""  # why a file that names the newest save is refused (DeepSpeed's latest)


def list_candidates(ckpt_dir: str | os.PathLike, *, read_steps: bool = True) -> list[Candidate]:
    """Every checkpoint dir and, where there are none, every checkpoint file, one per save;
    newest first. `read_steps=False` leaves a stepless file's step unread (no pickle walk: the
    watch loop's look at the dir each sample), ordering such files by time alone."""
    root = Path(ckpt_dir)
    dirs, found = [], []
    try:
        entries = os.scandir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    with entries:
        for entry in entries:
            step = _dir_step(entry.name)
            if step is not None:
                # Also a link or a file with a checkpoint dir's name: verification reports it.
                dirs.append(Candidate(root / entry.name, step, True, (step, 0, 0, 0.0)))
            elif _file_candidate(entry):
                # Not only regular files: a FIFO or a link leading out is listed, and refused
                # by _verify_file with the reason.
                found.append(entry)
    if dirs:
        dirs += _refused_latest(root, dirs)
        dirs.sort(key=lambda c: c.order, reverse=True)
        return dirs
    files = [(e.name, step_from_name(e.name), _mtime(e)) for e in _one_per_save(root, found)]
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


def _refused_latest(root: Path, dirs: list[Candidate]) -> list[Candidate]:
    """DeepSpeed's `latest` when it names no tag dir beside it (`../../etc`): listed first, so
    that the refusal is reported (inspect, skipped_checkpoint) and the dirs are judged alone."""
    if not any(c.path.name.startswith("global_step") for c in dirs):
        return []
    _, why = layouts.read_latest(root)
    if not why:
        return []
    top = max(c.order[0] for c in dirs)
    return [Candidate(root / layouts.LATEST, None, True, (top + 1, 0, 0, 0.0), refused=why)]


def _one_per_save(root: Path, entries: list[os.DirEntry]) -> list[os.DirEntry]:
    """One entry per save: a link to another candidate (Composer's latest-rank0.pt) and a hard
    link of one (timm's last.pth.tar and checkpoint-N.pth.tar) are the same save; the name that
    states a step stands for it."""
    real = {}
    for e in entries:
        if not e.is_symlink():
            real[os.path.realpath(e.path)] = e
    out, inodes = [], {}
    for e in entries:
        if e.is_symlink():
            if os.path.realpath(e.path) in real:
                continue  # an alias of a listed file
            out.append(e)
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            out.append(e)
            continue
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            other = inodes.get(key)
            if other is not None:
                if step_from_name(e.name) is not None and step_from_name(other.name) is None:
                    out[out.index(other)] = e
                    inodes[key] = e
                continue
            inodes[key] = e
        out.append(e)
    return out


def _file_candidate(entry: os.DirEntry) -> bool:
    name = entry.name
    if (name.startswith(".") or name in _NOT_CHECKPOINTS or _TEMP.match(name)
            or is_best_copy(name) or _OTHER_RANK.search(_stem(name)) or entry.is_dir()):
        return False
    return name.endswith(FILE_SUFFIXES) or says_torch_save(entry)


def says_torch_save(entry: os.DirEntry) -> bool:
    """Whether a regular file's first bytes are torch.save's: the zip whose first member is
    `data.pkl`, or the legacy pickle's magic number. Links are not followed (a link is a
    candidate by its name only); the answer is kept per inode, size and mtime."""
    try:
        if not entry.is_file(follow_symlinks=False):
            return False
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    key = (entry.path, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _sniffed.get(key)
    if hit is not None:
        return hit
    try:
        fd = os.open(entry.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False
    try:
        head = os.pread(fd, 512, 0)
    except OSError:
        head = b""
    finally:
        os.close(fd)
    said = head.startswith(_LEGACY_MAGIC)
    if head.startswith(_ZIP_MAGIC) and len(head) >= 30:
        n = int.from_bytes(head[26:28], "little")
        first = head[30:30 + n]
        said = first == b"data.pkl" or first.endswith(b"/data.pkl")
    if len(_sniffed) >= 4096:
        _sniffed.clear()
    _sniffed[key] = said
    return said


def resume_entries(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Every entry of the dir a resume pick could ever consider: the checkpoint dirs (and
    DeepSpeed's `latest`, which names one) and the checkpoint files (`list_candidates` shows
    the files only where there are no dirs; with the dirs gone, the files would be next)."""
    root = Path(ckpt_dir)
    try:
        with os.scandir(root) as entries:
            found = sorted(root / e.name for e in entries
                           if _dir_step(e.name) is not None or _file_candidate(e))
    except (FileNotFoundError, NotADirectoryError):
        return []
    if any(p.name.startswith("global_step") for p in found) and (
            root / layouts.LATEST).is_file():
        found.append(root / layouts.LATEST)
    return found


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


def _verify_layout(path: Path, layout: layouts.Layout, level: Level) -> Verdict:
    report = layouts.check(path, layout, full=level is Level.FULL)
    status = (Status.OK if not report.problem
              else Status.INCOMPLETE if report.incomplete else Status.CORRUPT)
    return Verdict(path, -1 if report.step is None else report.step, status, report.problem,
                   format=layout.value, info=report.info)


def is_hf_dir(path: Path) -> bool:
    return not (path / MANIFEST).exists() and hf_trainer.looks_like(path)


def layout_dir(path: Path) -> layouts.Layout | None:
    """The layout of a foreign save directory (accelerate, DeepSpeed, DCP); None for rtrain's
    own (manifest.json), a Trainer's, or any other directory."""
    if os.path.lexists(path / MANIFEST):
        return None
    return layouts.layout_of(path)


def verify_path(path: str | os.PathLike, level: Level | str = Level.FULL,
                key: bytes | None = None) -> Verdict:
    """One checkpoint of any format: a directory (rtrain's, a Trainer's, a save of accelerate,
    DeepSpeed or DCP) or a file."""
    path, level = Path(path), Level(level)
    # A checkpoint file (a FIFO or link with such a name too: refused there with the reason),
    # or any regular file; everything else is a directory, whose manifest.load refuses links.
    if (path.name.endswith(FILE_SUFFIXES) and not path.is_dir()) or (
            path.is_file() and not path.is_symlink()):
        return _verify_file(path, level, step_from_name(path.name))
    layout = layout_dir(path)
    if layout is not None:
        return _verify_layout(path, layout, level)
    verdict = rverify.verify(path, level, key)
    if verdict.status is Status.INCOMPLETE and is_hf_dir(path):
        return _verify_hf(path, level)
    return verdict


def verify_candidate(c: Candidate, level: Level | str, key: bytes | None = None) -> Verdict:
    if c.refused:
        return Verdict(c.path, -1, Status.CORRUPT, c.refused, format=Format.DEEPSPEED.value,
                       info={"step": None})
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
