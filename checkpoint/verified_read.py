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

import contextlib
import os
import stat
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing
from rtrain.checkpoint.verify import check_member_name

# A few MiB per read: per-call overhead is nothing at that size, and the hash reads a chunk
# just after the read wrote it, from cache rather than from memory.
_CHUNK = 4 << 20
# Large reads run on reader threads a few chunks ahead of the hash, which the calling thread
# feeds in file order: the copy out of the page cache (and the faults of fresh memory) on one
# core overlaps the hash on another (read and xxh3 of 1 GiB: 0.29 s against 0.38 s in turn, on
# 2 cores when idle; no gain when other work holds the other core). The window is small so
# hashed chunks are still in cache.
_READERS = 2
_AHEAD = 4
_PARALLEL_FROM = 32 << 20


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
        with contextlib.suppress(OSError, AttributeError):  # a hint only: larger readahead
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
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
        """Fill `buf` (a writable byte view) from the current position, hashing it in order."""
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        if self.pos + view.nbytes > self.size:
            raise LoadError(f"{self.name}: reading past the end ({self.pos} + {view.nbytes} of "
                            f"{self.size} bytes)")
        spans = [(s, min(s + _CHUNK, view.nbytes)) for s in range(0, view.nbytes, _CHUNK)]
        if view.nbytes < _PARALLEL_FROM:
            for s, e in spans:
                self._fill(view[s:e], self.pos + s)
                self.hasher.update(view[s:e])
        else:
            self._read_ahead(view, spans)
        self.pos += view.nbytes

    def _read_ahead(self, view: memoryview, spans: list[tuple[int, int]]) -> None:
        pool = ThreadPoolExecutor(_READERS, thread_name_prefix="rtrain-read")
        try:
            todo = iter(spans)
            pending: deque = deque()

            def submit() -> None:
                span = next(todo, None)
                if span is not None:
                    s, e = span
                    pending.append((s, e, pool.submit(self._fill, view[s:e], self.pos + s)))

            for _ in range(_AHEAD):
                submit()
            while pending:
                s, e, done = pending.popleft()
                done.result()
                submit()
                self.hasher.update(view[s:e])
        finally:
            # No reader may still write into `view` once this returns or raises.
            pool.shutdown(wait=True, cancel_futures=True)

    def _fill(self, chunk: memoryview, offset: int) -> None:
        got = 0
        while got < chunk.nbytes:
            n = os.preadv(self.fd, [chunk[got:]], offset + got)
            if n == 0:
                raise LoadError(f"{self.name} ended early (changed while being read)")
            got += n

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def finish(self) -> None:
        """Every byte was read and hashes to the manifest's value, or LoadError."""
        if self.pos != self.size:
            raise LoadError(f"{self.name}: read {self.pos} of {self.size} bytes")
        if os.pread(self.fd, 1, self.size):
            raise LoadError(f"{self.name} grew while being read")
        if self.hasher.hexdigest() != self.expected:
            raise LoadError(f"{self.name}: content hash does not match the manifest (the file "
                            "changed after it was verified, or was replaced)")


def open_listed(root: Path, name: str, manifest: dict[str, Any], alg: str,
                enc: Any = None) -> Any:
    """`ListedFile`, or for an encrypted checkpoint a `sealed.Decryptor` over it (the same
    interface, for the plaintext: the hash is of the file's bytes, the tags authenticate what
    is returned). `enc`: the `crypt.EncryptionKey`; a checkpoint it cannot open is a LoadError
    naming the fingerprints (callers check `crypt.key_problem` first for a clearer error)."""
    if manifest.get("encryption") is None:
        return ListedFile(root, name, manifest, alg)
    from rtrain.checkpoint import crypt, encrypted_file  # they import this module

    problem = crypt.key_problem(manifest, enc)
    if problem is not None:
        raise LoadError(problem)
    raw = ListedFile(root, name, manifest, alg)
    try:
        return encrypted_file.Decryptor(raw, enc, name)
    except BaseException:
        raw.close()
        raise


def read_listed(root: Path, name: str, manifest: dict[str, Any], alg: str,
                limit: int = 256 << 20, enc: Any = None) -> bytes:
    """The whole content of a small listed file (state.json), verified (and decrypted)."""
    with open_listed(root, name, manifest, alg, enc) as f:
        if f.size > limit:
            raise LoadError(f"{name} has {f.size} bytes, more than the {limit >> 20} MiB "
                            "rtrain reads for it")
        data = f.read(f.size)
        f.finish()
    return data
