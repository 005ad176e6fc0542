"""Read a checkpoint's files once, hashing every byte on the way: verified and used are the same
bytes.

Verifying a checkpoint and then loading it reads each file twice, and between the two reads a
file can be replaced by another of the same size (the supervisor verifies fully, the worker
loads later). Here the bytes a loader uses are the bytes that were hashed: `ListedFile` reads
a file listed in the manifest into the caller's buffers, hashes each chunk as it lands, and
`finish()` compares the hash with the manifest before the caller may use what it read.

Only files the manifest lists are opened, only regular files (a FIFO or device would block or
never end), never through a symlink at the last component (the manifest's names were checked
against leaving the checkpoint; a link swapped in later is refused here).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from supervisor.ckpt import hashing
from supervisor.ckpt.verify import check_member_name

_CHUNK = 16 << 20


class LoadError(ValueError):
    """A listed file cannot be read or does not match the manifest; str() is the reason."""


class ListedFile:
    """One file of `manifest["files"]`, open for one pass of hashed reads.

        with ListedFile(ckpt, "model.safetensors", manifest, alg) as f:
            f.readinto(buffer) ...
            f.finish()          # raises LoadError unless every byte was read and matches
    """

    def __init__(self, root: Path, name: str, manifest: dict[str, Any], alg: str) -> None:
        entry = manifest.get("files", {}).get(name)
        if entry is None:
            raise LoadError(f"the manifest does not list {name}")
        self.name, self.size, self.expected = name, int(entry["size"]), entry["hash"]
        try:
            path = check_member_name(root, name)
        except ValueError as e:
            raise LoadError(str(e)) from None
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            self.fd = os.open(path, flags)
        except OSError as e:
            raise LoadError(f"cannot open {name}: {e.strerror or e}") from None
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise LoadError(f"{name} is not a regular file")
        if st.st_size != self.size:
            os.close(self.fd)
            raise LoadError(f"{name} has {st.st_size} bytes, the manifest says {self.size}")
        self.hasher = hashing.new_hasher(alg)
        self.pos = 0

    def __enter__(self) -> ListedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def readinto(self, buf: memoryview) -> None:
        """Fill `buf` (a writable byte view) from the current position, hashing it."""
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if self.pos + view.nbytes > self.size:
            raise LoadError(f"{self.name}: reading past the end ({self.pos} + {view.nbytes} of "
                            f"{self.size} bytes)")
        done = 0
        while done < view.nbytes:
            chunk = view[done:done + _CHUNK]
            got = 0
            while got < chunk.nbytes:
                n = os.readv(self.fd, [chunk[got:]])
                if n == 0:
                    raise LoadError(f"{self.name} ended early (changed while being read)")
                got += n
            self.hasher.update(chunk)
            done += chunk.nbytes
        self.pos += view.nbytes

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def finish(self) -> None:
        """Every byte was read and hashes to the manifest's value, or LoadError."""
        if self.pos != self.size:
            raise LoadError(f"{self.name}: read {self.pos} of {self.size} bytes")
        if os.read(self.fd, 1):
            raise LoadError(f"{self.name} grew while being read")
        if self.hasher.hexdigest() != self.expected:
            raise LoadError(f"{self.name}: content hash does not match the manifest (the file "
                            "changed after it was verified, or was replaced)")


def read_listed(root: Path, name: str, manifest: dict[str, Any], alg: str,
                limit: int = 256 << 20) -> bytes:
    """The whole content of a small listed file (state.json), verified."""
    with ListedFile(root, name, manifest, alg) as f:
        if f.size > limit:
            raise LoadError(f"{name} has {f.size} bytes, more than the {limit >> 20} MiB "
                            "rtrain reads for it")
        data = f.read(f.size)
        f.finish()
    return data
