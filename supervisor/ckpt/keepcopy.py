"""rtrain's copy of a foreign checkpoint that its script rewrites in place.

A script that keeps one `ckpt.pt` and `torch.save`s over it loses everything when it is killed
mid-write: the file is left empty or cut short, and the content it held seconds before is gone.
So rtrain keeps one copy of the newest verified content of such a file (a foreign file whose
name states no step: the name is reused, so the content is not kept anywhere else):

- **When.** Each time a launch picks it to resume from (it has verified at the configured
  level) and its content differs from the copy's: so at each relaunch, before the script can
  rewrite it again.
- **How.** A reflink (FICLONE) where the filesystem offers one (btrfs, XFS, bcachefs: no
  blocks copied until the script rewrites its file), else `os.copy_file_range`, else a plain
  copy; into a temp file in `<run_dir>/foreign-copy/`, which must itself verify (full CRCs and
  the pickle walk) before it is fsynced and renamed over the previous copy. The copy is what
  is checked, not the live file, so a write racing the copy can never be kept.
- **Restore.** When the live file fails verification at a later pick (empty, truncated, a bad
  CRC, an unsafe pickle, a directory where the file was), the copy, verified again, is written
  to a temp file beside it and renamed over it (a directory there is moved aside to
  `.<name>.refused-<time>`). A file that is gone is not restored: deleting it is a person's
  way to start over. Nothing is restored over a file that verifies.

`kept.json` beside the copy records it: {"version", "source", "fingerprint", "step",
"verified_at", "bytes", "how", "mac"}. The run dir may be writable by a group, and the record
says what to overwrite, so it is trusted only when rtrain wrote it (`read`): signed with this
user's key (proc/userkey.py, as procs.json is: an HMAC over the record and the run dir), its
`source` a stepless checkpoint file's name in an absolute, normalized path (no `..`; the caller
also requires the checkpoint dir as its parent), and, at a restore, the live path no link and
the copy's content the one recorded. A record that fails any of these is ignored, with one
line: nothing is restored from it, and nothing is moved aside. Without a key (no home to keep
one in) records are written unsigned and never restored from.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rtrain.checkpoint import safeio
from rtrain.checkpoint.layout import parse_step
from rtrain.checkpoint.verify import Level, Status, Verdict
from rtrain.supervisor.ckpt import foreign, progress
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import write_json_atomic
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE
from rtrain.supervisor.proc import userkey

KEPT_DIR = "foreign-copy"
RECORD = "kept.json"
VERSION = 1
_FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int)
_CHUNK = 64 << 20


@dataclass(frozen=True, kw_only=True)
class Kept:
    source: str  # the live file, absolute
    fingerprint: str  # progress.fingerprint of the content copied
    step: int | None
    verified_at: float  # unix time the copy verified
    bytes: int
    how: str  # "reflink", "copy_file_range" or "copy"

    def copy_path(self, run_dir: Path) -> Path:
        return run_dir / KEPT_DIR / Path(self.source).name


def wants_copy(v: Verdict | None) -> bool:
    """A verified foreign file whose name states no step: one the script rewrites in place."""
    return (v is not None and v.ok and v.format in (foreign.Format.TORCH.value,
                                                    foreign.Format.LIGHTNING.value)
            and foreign.step_from_name(v.path.name) is None and not v.path.is_symlink()
            and v.path.is_file())


def load(run_dir: Path) -> Kept | None:
    """The run's copy as rtrain recorded it; None when there is none, or no record rtrain
    can trust (`read` says why)."""
    return read(run_dir)[0]


def read(run_dir: Path) -> tuple[Kept | None, str | None]:
    """(the record, None) when rtrain wrote it; (None, why it is ignored) when a record is
    there that rtrain cannot trust; (None, None) when there is none or it is unreadable (the
    next keep rewrites it)."""
    try:
        raw = safeio.parse_object(ownfiles.read_own(run_dir / KEPT_DIR / RECORD,
                                                    limit=1 << 16, what=RECORD), RECORD)
        if raw.get("version") != VERSION:
            return None, None
        kept = Kept(source=str(raw["source"]), fingerprint=str(raw["fingerprint"]),
                    step=raw.get("step"), verified_at=float(raw["verified_at"]),
                    bytes=int(raw["bytes"]), how=str(raw["how"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    key, no_key = userkey.load(create=False)
    if key is None:
        return None, f"its signature cannot be checked ({no_key})"
    if not userkey.verify(key, _signed_part(kept, run_dir), raw.get("mac")):
        return None, ("it is not signed by an rtrain of this user (written by someone else, "
                      "by an older rtrain, or for another run dir)")
    why = source_problem(kept.source)
    if why is not None:
        return None, why
    return kept, None


def source_problem(source: str) -> str | None:
    """Why `source` cannot be a file rtrain keeps a copy of, or None: an absolute, normalized
    path (no `..`) naming a checkpoint file that states no step (a file the script rewrites in
    place; a checkpoint dir or a step-named file is never one)."""
    name = os.path.basename(source)
    if not os.path.isabs(source) or os.path.normpath(source) != source or "\0" in source:
        return f"its source {source[:200]!r} is not a plain absolute path"
    if (not name.endswith(foreign.FILE_SUFFIXES) or name.startswith(".")
            or foreign.step_from_name(name) is not None or parse_step(name) is not None):
        return f"its source {name[:100]!r} is not a checkpoint file the script rewrites in place"
    return None


def _signed_part(kept: Kept, run_dir: Path) -> bytes:
    """What the HMAC covers: the record and the run dir it is for (a record copied from
    another run dir of the same user does not verify there)."""
    part = {"version": VERSION, **asdict(kept), "run_dir": str(Path(run_dir).resolve())}
    return json.dumps(part, sort_keys=True, separators=(",", ":")).encode()


def keep(run_dir: Path, v: Verdict, *, mode: int = DEFAULT_FILE_MODE,
         now: float | None = None) -> Kept | None:
    """Copy `v`'s file into the run dir when its content is not the copy's already; the new
    record, or None when nothing was copied (same content, or the copy did not verify: the
    old copy stays). Storage errors are the caller's to report."""
    source = v.path.resolve()
    old = load(run_dir)
    live_fp = progress.fingerprint(source)
    if live_fp is None:
        return None
    if old is not None and old.source == str(source) and old.fingerprint == live_fp and (
            old.copy_path(run_dir).is_file()):
        return None
    kept_dir = run_dir / KEPT_DIR
    ownfiles.own_dir(kept_dir, mode)  # a link there would take the copy elsewhere
    tmp = kept_dir / f".{source.name}.tmp"
    try:
        how = _clone(source, tmp, mode)
        check = foreign.verify_path(tmp, Level.FULL)
        fp = progress.fingerprint(tmp)
        if not check.ok or fp is None:
            tmp.unlink(missing_ok=True)
            return None
        final = kept_dir / source.name
        os.replace(tmp, final)
        _fsync_dir(kept_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    record = Kept(source=str(source), fingerprint=fp, step=check.step if check.step >= 0
                  else None, verified_at=time.time() if now is None else now,
                  bytes=final.stat().st_size, how=how)
    body: dict[str, object] = {"version": VERSION, **asdict(record)}
    key, _ = userkey.load(create=True)
    if key is not None:  # without one the record is kept unsigned: never restored from
        body["mac"] = userkey.sign(key, _signed_part(record, run_dir))
    write_json_atomic(kept_dir / RECORD, body, mode=mode)
    if old is not None and Path(old.source).name != source.name:
        old.copy_path(run_dir).unlink(missing_ok=True)  # one copy: the previous file's goes
    return record


def forget(run_dir: Path) -> None:
    """Drop the record of the run's copy (a run started over: the copy is of the earlier
    run's file and must never be put back under the new run's). The copy itself is left for
    the next keep to replace."""
    try:
        (run_dir / KEPT_DIR / RECORD).unlink()
    except FileNotFoundError:
        pass


def torn(path: Path, level: Level) -> str | None:
    """Why the live file at `path` cannot be resumed from (the reason a person reads); None
    when it verifies or is gone."""
    if path.is_dir() and not path.is_symlink():
        return "a directory where a file was expected"
    if not os.path.lexists(path):
        return None
    v = foreign.verify_path(path, level)
    if v.ok or (v.status is Status.INCOMPLETE and not os.path.lexists(path)):
        return None
    return v.reason or v.status.value


class NotRestored(OSError):
    """The copy is not the one recorded, or the live path is a link: nothing was touched."""


def restore(run_dir: Path, kept: Kept, *, mode: int = DEFAULT_FILE_MODE) -> None:
    """Put the copy back where the script reads it (the caller checked that the live file
    fails verification and that the copy verifies). Refused (NotRestored) when the copy's
    content is not the one the record names, or a link stands at the live path: rtrain
    writes only what it copied, only over the file it copied it from."""
    live = Path(kept.source)
    if progress.fingerprint(kept.copy_path(run_dir)) != kept.fingerprint:
        raise NotRestored("the copy is not the content rtrain recorded")
    if live.is_symlink():
        raise NotRestored(f"{live.name} is a link now")
    tmp = live.parent / f".{live.name}.rtrain-restore"
    try:
        _clone(kept.copy_path(run_dir), tmp, mode)
        if live.is_dir() and not live.is_symlink():
            os.rename(live, live.parent / f".{live.name}.refused-{time.time_ns()}")
        os.replace(tmp, live)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(live.parent)


def _clone(src: Path, dst: Path, mode: int) -> str:
    """Copy `src` to `dst`, a temp name of ours (created anew: what a killed rtrain left there,
    or a link planted at the name, is removed, never written through; fsynced); how it was
    done."""
    src_fd = ownfiles.open_own(src).fd
    try:
        fd = ownfiles.create_fresh(dst, mode)
        try:
            how = _copy_fd(src_fd, fd, os.fstat(src_fd).st_size)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        os.close(src_fd)
    return how


def _copy_fd(src: int, dst: int, size: int) -> str:
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return "reflink"
    except OSError:
        pass  # not offered here (ext4, tmpfs, across filesystems): copy the bytes
    try:
        left = size
        while left > 0:
            n = os.copy_file_range(src, dst, min(left, _CHUNK))
            if n == 0:
                break
            left -= n
        if left == 0:
            return "copy_file_range"
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
            raise
    os.lseek(src, 0, os.SEEK_SET)
    os.ftruncate(dst, 0)
    os.lseek(dst, 0, os.SEEK_SET)
    while chunk := os.read(src, _CHUNK):
        view = memoryview(chunk)
        while view:
            view = view[os.write(dst, view):]
    return "copy"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe(kept: Kept) -> str:
    """One line for status and the launch: what is kept and what it costs on disk."""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(kept.verified_at))
    step = f"step {kept.step}, " if kept.step is not None else ""
    cost = (f"{kept.bytes / 2**20:.1f} MiB" + (" (a reflink: shared with the file until it is "
                                                "rewritten)" if kept.how == "reflink" else ""))
    return f"{Path(kept.source).name} ({step}verified {at}): {cost}"

