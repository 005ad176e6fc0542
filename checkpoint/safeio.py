"""Reading files of a checkpoint that anyone with write access to the directory may have made.

Every reader of checkpoint files (the supervisor's verifiers and inspectors, the worker's
restore) opens them through `open_regular`, so that none of them can be made to hang or to read
outside the checkpoint:

- only regular files are opened: a FIFO would block `open()` until a writer comes (forever), a
  device may have side effects or never end, a socket cannot be opened at all. The type is
  checked before opening (lstat/stat), the open itself is non-blocking, and the type is checked
  again on the open descriptor (the name may have been swapped in between);
- a symbolic link is refused unless the caller allows links (`follow_symlinks`, for names it
  has already checked stay inside the checkpoint, see `verify.check_member_name`);
  `open_beneath` refuses a link at every step of a name inside a directory (what leaves the
  machine, the mirror's uploads, follows none);
- `read_limited` refuses a file larger than the caller's limit before reading a byte of it, and
  `parse_json` refuses what would cost far more than its size to parse or use (deep nesting,
  numbers too large for a float, NaN and Infinity literals).
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
from typing import Any, BinaryIO

MAX_DEPTH = 64
"""Deepest nesting a checkpoint's JSON may have. rtrain's manifest needs 5 levels (tensors ->
file -> tensor -> [dtype, shape] -> shape); the rest is room for nested settings and info."""


class UnsafeFile(OSError):
    """A file that is refused unread; `strerror` is the reason a person reads."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(errno.EINVAL, reason, os.fspath(path))


def kind(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: str | os.PathLike, *, follow_symlinks: bool = False) -> os.stat_result:
    """The file's stat if it is a regular file (through a link only if allowed); raises
    `UnsafeFile` otherwise, FileNotFoundError if it is not there."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if not follow_symlinks:
            raise UnsafeFile(path, "is a symbolic link: not followed")
        st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(path, f"is {kind(st.st_mode)}, not a regular file")
    return st


def _open_fd(path: str | os.PathLike, follow_symlinks: bool) -> tuple[int, os.stat_result]:
    check_regular(path, follow_symlinks=follow_symlinks)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:  # became a link since the lstat above
            raise UnsafeFile(path, "is a symbolic link: not followed") from None
        raise
    # O_NONBLOCK stays set: it has no effect on a regular file.
    return fd, _regular(fd, path)


def open_regular(path: str | os.PathLike, *, follow_symlinks: bool = False,
                 buffering: int = -1) -> BinaryIO:
    """Open a regular file for reading in binary mode; never blocks on a FIFO or opens a
    device. Raises `UnsafeFile` (an OSError) for anything else."""
    fd, _ = _open_fd(path, follow_symlinks)
    return os.fdopen(fd, "rb", buffering=buffering)


def open_beneath(root: str | os.PathLike, member: str, *, buffering: int = -1) -> BinaryIO:
    """Open `member` ('/'-separated, relative) of directory `root` for reading, following no
    link anywhere: not `root` itself, not a directory on the way, not the file. Each step opens
    relative to the directory opened before it, so a name swapped for a link meanwhile is
    refused too. Raises `UnsafeFile` (naming the step) for a link or anything but a regular
    file at the end, FileNotFoundError when a step is missing."""
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = _open_step(root, dir_flags, None, root)
    try:
        parts = member.split("/")
        for i, part in enumerate(parts[:-1]):
            step = os.path.join(root, *parts[:i + 1])
            nfd = _open_step(part, dir_flags, fd, step)
            os.close(fd)
            fd = nfd
        last = os.path.join(root, member)
        st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):  # checked before opening: a device is never opened
            raise UnsafeFile(last, "is a symbolic link: not followed" if stat.S_ISLNK(st.st_mode)
                             else f"is {kind(st.st_mode)}, not a regular file")
        ffd = _open_step(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         fd, last)
    finally:
        os.close(fd)
    _regular(ffd, last)
    return os.fdopen(ffd, "rb", buffering=buffering)


def _regular(fd: int, path: str | os.PathLike) -> os.stat_result:
    """`fd`'s stat when it is a regular file's; else `fd` is closed and UnsafeFile raised (the
    name was swapped between the check before opening and the open)."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(path, f"is {kind(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return st


def _open_step(name: str | os.PathLike, flags: int, dir_fd: int | None,
               shown: str | os.PathLike) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            raise e from None
        if stat.S_ISLNK(mode):
            raise UnsafeFile(shown, "is a symbolic link: not followed") from None
        raise UnsafeFile(shown, f"is {kind(mode)}, not a directory") from None


def read_limited(path: str | os.PathLike, limit: int, *,
                 follow_symlinks: bool = False) -> bytes:
    """The whole of a regular file of at most `limit` bytes; a larger one is refused unread."""
    fd, st = _open_fd(path, follow_symlinks)
    try:
        if st.st_size > limit:
            raise UnsafeFile(path, f"is {st.st_size} bytes, more than the {limit >> 20} MiB "
                                   "a checkpoint's metadata may take")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, limit + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while we read
        raise UnsafeFile(path, f"is more than the {limit >> 20} MiB a checkpoint's metadata "
                               "may take")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"holds the number {text[:40]}, too large for a float")
    return value


def parse_json(raw: bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON with bounded cost; raises ValueError with the reason (no position details a
    person cannot use)."""
    if nested_deeper(raw, max_depth):
        raise ValueError(f"is nested more than {max_depth} levels deep")
    try:
        return _DECODER.decode(raw.decode("utf-8"))
    except RecursionError:  # not reached after the check above; kept as the last line
        raise ValueError(f"is nested more than {max_depth} levels deep") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"is not valid JSON ({e})") from None
    except UnicodeDecodeError:
        raise ValueError("is not valid JSON (not UTF-8 text)") from None
    except ValueError as e:  # our hooks, and ints past sys.get_int_max_str_digits()
        raise ValueError(str(e) if str(e).startswith("holds") else
                         f"holds a number too large to read ({e})") from None


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)
# A JSON string, escapes included (brackets inside strings do not nest); unrolled for speed.
# An unterminated one runs to the end: otherwise every later quote would start a new scan to
# the end, quadratic time on a file of quotes and backslashes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nested_deeper(raw: bytes, max_depth: int) -> bool:
    """Whether the brackets of a JSON text nest deeper than `max_depth`, found before parsing
    (so a bomb never reaches the recursive parser) at C speed: strings cut out, the rest reduced
    to brackets, then the innermost pairs removed once per level. Malformed text may pass; the
    parser refuses it."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:
            return False  # unbalanced: not JSON, which the parser says
    return bool(brackets)


def parse_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """`parse_json` for a document that must be a JSON object; the ValueError names `what`."""
    try:
        obj = parse_json(raw)
    except ValueError as e:
        raise ValueError(f"{what} {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{what} is not a JSON object")
    return obj
