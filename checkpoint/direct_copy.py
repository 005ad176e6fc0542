"""Copy a file into a new one past the page cache (O_DIRECT), hashing every byte copied.

Why. rtrain copies memory-tier snapshots into the checkpoint dir while the training runs beside
it: the disk saves the worker hands over, and the snapshot an attempt ended with. Written
through the page cache, every 4 KiB page of the new file is allocated, filled by a copy and
written back later: 170-400 ms of CPU for 126 MiB on the 2-core machine the benchmarks use,
taken from a training that keeps both cores busy (it showed as a step 2-4 times its length
after each handed save). With O_DIRECT the disk reads one reused, page-aligned buffer itself,
so the copy costs the read from shared memory and the hash: 47-56 ms of CPU for the same file
(docs/benchmarks.md). Nothing of the new file stays in the page cache, which suits a checkpoint:
it is read back at a restore, if ever, and the memory tier holds the newest step in memory.

The source is read with read(), not through a mapping: a worker alive beside the copy could
shrink its file, and a mapping read past the new end kills the reader with SIGBUS, where read()
returns short. What is hashed is the buffer that is written, so the hash describes the copy.

Where O_DIRECT is refused (tmpfs and some network filesystems refuse it at the open or the first
write, with EINVAL) the copy goes through the page cache as before. O_DIRECT writes whole blocks
at block offsets: the file's last partial block, and everything after a short read, are written
after clearing the flag.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import BinaryIO

from rtrain.checkpoint.safetensors_io import write_hashed

CHUNK = 8 << 20
BLOCK = 4096  # the largest logical block size O_DIRECT asks alignment to, in practice
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class _NoHash:
    def update(self, data: object) -> None:
        pass


def copy_hashed(src: BinaryIO, dst: Path, hasher, *, fsync: bool = True) -> int:
    """Copy `src` (an unbuffered file open for reading, at its start) into `dst`, created
    exclusively (mode 0600; the caller sets the final mode); every byte copied goes through
    `hasher`. Returns the size copied. OSError as the write raises it (ENOSPC, EIO)."""
    buf = mmap.mmap(-1, CHUNK)  # anonymous: page-aligned, as O_DIRECT wants the memory
    view = memoryview(buf)
    try:
        fd, direct = _create(dst)
        try:
            size = 0
            while n := src.readinto(view):
                hasher.update(view[:n])
                done = 0
                if direct:
                    done, direct = _write_direct(fd, view[:n - n % BLOCK])
                    if done < n:  # the tail, or O_DIRECT refused: the page cache from here
                        _clear_direct(fd)
                        direct = False
                size += done
                if done < n:  # hashed above already: not fed to the hasher twice
                    size = write_hashed(fd, view[done:n], _NoHash(), size)
            if fsync:
                os.fsync(fd)
            return size
        finally:
            os.close(fd)
    finally:
        try:
            view.release()
            buf.close()
        except BufferError:  # a slice held by the exception's frames: the map goes with them
            pass


def _create(dst: Path) -> tuple[int, bool]:
    """The new file's fd, and whether it is open with O_DIRECT."""
    if _O_DIRECT:
        try:
            return os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _O_DIRECT,
                           0o600), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), False


def _write_direct(fd: int, data: memoryview) -> tuple[int, bool]:
    """Write whole blocks with O_DIRECT; returns (bytes written, whether O_DIRECT still
    holds): False after an EINVAL (the filesystem refuses it) or a short write, which leaves
    the file offset where aligned writes can no longer follow."""
    done = 0
    while done < data.nbytes:
        try:
            n = os.write(fd, data[done:])
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            return done, False
        done += n
        if n % BLOCK:
            return done, False
    return done, True


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
