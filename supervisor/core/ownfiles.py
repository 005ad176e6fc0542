"""Opening the files rtrain keeps in the run and checkpoint dirs, torch-free, used by both halves.

Anyone who can write those directories can plant something at a name rtrain uses. Every file
rtrain opens there in place (the lock, events.jsonl, the generation token, the uploader's lock,
attempt, standby and mirror logs, stack dumps) and every file it reads there (state.json,
procs.json, events.jsonl, exit records, the lock's holder) goes through `open_own` or
`read_own`, so that:

- a symbolic link is refused, never followed (O_NOFOLLOW): a link to `~/victim` at
  `.rtrain-generation` would otherwise have it overwritten with a token;
- only a regular file is opened: the type is checked (lstat) before opening, so a device is
  never opened, and the open is non-blocking, so a FIFO can never hang it (O_NONBLOCK, cleared
  once the descriptor is known to be a regular file's); the type is checked again on the
  descriptor, the name may have been swapped in between;
- a file written in place must have no other name (one hard link): a second name would make an
  append or a truncation change that other file too;
- a file created here is created exclusively (O_EXCL) and given the run's mode; rtrain only
  ever chmods what it created or what passes the checks above and belongs to this user.

This is the one rule for every file rtrain opens in a directory others may write (the run dir,
the checkpoint dir, their `trackers/`, `foreign-copy/` and peer registry subdirs, anything added
later): reads go through `read_own` (bounded: a caller passes the most its file ever holds) or
`open_own`, a subdirectory rtrain keeps files in through `own_dir` (never a link to elsewhere),
a temp file through `create_fresh`, a whole-file replace through `atomic_write`.
tests/test_shared_dir_opens.py walks the code for any other open of such a path.

A refusal is `RefusedFile`: an OSError (best-effort writers treat it as a file they cannot
write, and say so) and a UsageError (exit 2 at the command line, one line naming the file and
what to do). Files that are replaced whole (state.json, procs.json, exit records, quarantine
notes: `atomic_write.write_atomic`) are safe at their final name already: the rename replaces a
link, never writes through it, and the temp file is created exclusively; a temp file at a fixed name
(the kept copy of a foreign checkpoint) is made by `create_fresh`.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE, dir_mode, make_dir, set_mode
from rtrain.supervisor.core.untrusted_text import safe

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_ALWAYS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class RefusedFile(UsageError, OSError):
    """A file at one of rtrain's names that rtrain will not open: a link, not a regular file,
    a second name of another file, or content no rtrain writes. `str()` is the one line a
    person reads."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = os.fspath(path)
        self.reason = reason
        OSError.__init__(self, errno.EINVAL, reason, self.path)

    def __str__(self) -> str:
        return (f"{safe(self.path)} {self.reason}; rtrain opens only files it made there: "
                "remove it (or move it aside) and run again")


def describe(mode: int) -> str:
    """What a file of this st_mode is, in words."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def _refuse_kind(path: str | os.PathLike, st: os.stat_result) -> RefusedFile:
    if stat.S_ISLNK(st.st_mode):
        try:
            target = f" (to {safe(os.readlink(path))})"
        except OSError:
            target = ""
        return RefusedFile(path, f"is a symbolic link{target}, which rtrain never follows")
    return RefusedFile(path, f"is {describe(st.st_mode)}, not a regular file")


def check(path: str | os.PathLike, *, in_place: bool = True) -> os.stat_result | None:
    """lstat only, nothing opened: None when `path` is absent, its stat when rtrain may use it
    (a regular file; with `in_place`, one of a single name); RefusedFile otherwise. For a
    command's preflight, so that it refuses before it changes anything."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_kind(path, st)
    if in_place and st.st_nlink > 1:
        raise RefusedFile(path, f"has {st.st_nlink} names (hard links), so writing it would "
                                "change another file too")
    return st


class _Vanished(Exception):
    """The file was there for the exclusive create and gone for the open that followed."""


@dataclass(frozen=True)
class Opened:
    fd: int
    created: bool
    """This open created the file (O_EXCL): rtrain's for certain."""
    st: os.stat_result
    """fstat of the descriptor at the open."""


def _open_once(path: str | os.PathLike, flags: int, create: bool, mode: int) -> Opened:
    if create:
        try:
            fd = os.open(path, flags | _ALWAYS | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            pass
        else:
            try:
                set_mode(fd, mode)  # exactly the run's mode: the umask cut the create's
                return Opened(fd, True, os.fstat(fd))
            except BaseException:
                os.close(fd)
                raise
    try:
        check(path, in_place=flags & (os.O_WRONLY | os.O_RDWR) != 0)
        fd = os.open(path, flags | _ALWAYS)
    except FileNotFoundError:
        if create:  # removed between the exclusive create and this open: try again
            raise _Vanished from None
        raise
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP, errno.ENODEV):
            try:
                raise _refuse_kind(path, os.lstat(path)) from None
            except FileNotFoundError:
                raise e from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the check and the open
            raise RefusedFile(path, f"is {describe(st.st_mode)}, not a regular file")
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise RefusedFile(path, f"has {st.st_nlink} names (hard links), so writing it "
                                    "would change another file too")
    except BaseException:
        os.close(fd)
        raise
    return Opened(fd, False, st)


def open_own(path: str | os.PathLike, flags: int = os.O_RDONLY, *, create: bool = False,
             mode: int = DEFAULT_FILE_MODE) -> Opened:
    """Open `path` (flags: O_RDONLY, O_WRONLY or O_RDWR, with O_APPEND as wanted; never
    O_TRUNC, O_CREAT or O_EXCL: `create` says whether a missing file is created, with `mode`).
    Blocking mode is restored on the descriptor, which is close-on-exec. FileNotFoundError
    when it is absent and not created; RefusedFile for anything rtrain must not open."""
    if flags & (os.O_TRUNC | os.O_CREAT | os.O_EXCL):
        raise ValueError("open_own never truncates or creates by flag: pass create=True")
    for _ in range(8):
        try:
            opened = _open_once(path, flags, create, mode)
            break
        except _Vanished:
            continue
    else:
        raise RefusedFile(path, "keeps appearing and disappearing")
    fl = fcntl.fcntl(opened.fd, fcntl.F_GETFL)
    fcntl.fcntl(opened.fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
    return opened


def own_mode(opened: Opened, mode: int) -> None:
    """Give an opened file the run's mode: one this open created has it already; an existing
    one (an older rtrain's) only when it is this user's. Someone else's keeps its mode."""
    if not opened.created and opened.st.st_uid == os.geteuid():
        set_mode(opened.fd, mode)


def read_own(path: str | os.PathLike, *, limit: int | None = None, what: str = "file") -> bytes:
    """The whole of a regular file rtrain keeps (never through a link, never blocking on a
    FIFO). FileNotFoundError when absent; RefusedFile for anything else, or for a file of
    more than `limit` bytes (refused unread)."""
    opened = open_own(path)
    fd = opened.fd
    try:
        if limit is not None and opened.st.st_size > limit:
            raise RefusedFile(path, f"is {opened.st.st_size} bytes, more than an rtrain {what} "
                                    f"ever holds ({limit} bytes)")
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if limit is not None and total > limit:  # grew while we read
                raise RefusedFile(path, f"is more than an rtrain {what} ever holds "
                                        f"({limit} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def create_fresh(path: str | os.PathLike, mode: int = DEFAULT_FILE_MODE) -> int:
    """A new, empty file at a temp name rtrain owns (`.x.tmp`): whatever is there (a leftover
    of a killed rtrain, or a link planted at the name) is removed first, never written
    through, then the file is created exclusively (FileExistsError if something took the name
    meanwhile). Returns a write descriptor with the given mode."""
    try:
        os.unlink(path)  # removes a link itself, never what it points to
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        raise RefusedFile(path, "is a directory, not a regular file") from None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    set_mode(fd, mode)
    return fd


def own_dir(path: str | os.PathLike, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """A subdirectory rtrain keeps files in (`trackers/`, `foreign-copy/`), made with the run's
    directory mode when missing. One that exists must be a directory itself: a symbolic link
    planted at the name would send rtrain's writes (and the removals of its old files) into
    whatever it points to, so it is refused (RefusedFile), as is any other kind of file."""
    try:
        try:
            os.mkdir(path, dir_mode(file_mode))
        except FileNotFoundError:  # its parent too (the run dir of a run not launched yet)
            make_dir(Path(path).parent, file_mode)
            os.mkdir(path, dir_mode(file_mode))
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise _refuse_kind(path, st) from None
        if not stat.S_ISDIR(st.st_mode):
            raise RefusedFile(path, f"is {describe(st.st_mode)}, not a directory") from None
    else:
        set_mode(Path(path), dir_mode(file_mode))  # mkdir's mode is cut by the umask
