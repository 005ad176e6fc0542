"""One safetensors file from the tensors of others, without torch: a new header, the same bytes.

A safetensors file is an 8-byte header length, a JSON header giving each tensor's dtype, shape
and byte span, then the data, packed without gaps (`safetensors_io.read_checked_header` refuses
a gap or an overlap). Exporting a model (rtrain's model.safetensors, a Trainer's shards, rtrain's
optimizer file beside it) is therefore a new header followed by each source's data section as
it is: bytes copied, never converted, so every exported tensor is bitwise the checkpoint's.

Each source is read once, in order, through a reader that checks what it read before the
output may be used: for rtrain's files a `verified_read` reader (hashed against the manifest,
decrypted when sealed; `finish()` compares), for a Trainer's a `PlainFile` (a regular file whose
size must not change while it is read). The caller writes into a temp file and publishes it
only when `concat` returned: a source that fails its hash half-way leaves only the temp file.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import safeio
from rtrain.checkpoint.safetensors_io import read_checked_header

_CHUNK = 8 << 20


class PlainFile:
    """A regular file read front to back with the interface of `verified_read.ListedFile`
    (`size`, `read`, `readinto`, `finish`, `close`): for files that come with no hash. What it
    can check is that the file stays the one it opened: no link at the last component unless
    allowed, a regular file, the same size from the open to `finish()`."""

    def __init__(self, path: str | os.PathLike, *, follow_symlinks: bool = True) -> None:
        self.name = Path(path).name
        self._f = safeio.open_regular(path, follow_symlinks=follow_symlinks, buffering=0)
        self.size = os.fstat(self._f.fileno()).st_size
        self.pos = 0

    def __enter__(self) -> PlainFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._f.close()

    def readinto(self, buf: memoryview) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        got = 0
        while got < view.nbytes:
            n = self._f.readinto(view[got:])
            if not n:
                raise ValueError(f"{self.name} ended early (changed while being read)")
            got += n
        self.pos += got

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def finish(self) -> None:
        st = os.fstat(self._f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.size or self.pos != self.size:
            raise ValueError(f"{self.name} changed while being read")


@dataclass(frozen=True)
class Part:
    """One source file: `open()` returns its reader (positioned at the start); its tensors
    are exported as `prefix + name`."""

    label: str
    open: Callable[[], Any]
    prefix: str = ""


@dataclass(frozen=True)
class Summary:
    tensors: int
    size: int


def concat(parts: Iterable[Part], out_fd: int, metadata: dict[str, str] | None = None
           ) -> Summary:
    """Write to `out_fd` one safetensors file holding every tensor of `parts`, in their order,
    then fsync it. Raises ValueError naming the source and what is wrong (a header that lies,
    a duplicate name, a hash that does not match) and `OSError` for the output's errors."""
    readers: list[tuple[Part, Any, dict[str, Any], int]] = []
    try:
        for part in parts:
            reader = part.open()
            readers.append((part, reader, {}, 0))
            try:
                entries, _, length = read_checked_header(reader)
            except ValueError as e:
                raise ValueError(f"{part.label}: {e}") from None
            readers[-1] = (part, reader, entries, length)
        header, count = _merged_header(readers, metadata)
        _write(out_fd, header)
        buf = memoryview(bytearray(_CHUNK))
        for part, reader, _, length in readers:
            left = length
            while left:
                view = buf[:min(left, _CHUNK)]
                reader.readinto(view)
                _write(out_fd, view)
                left -= view.nbytes
            try:
                reader.finish()
            except ValueError as e:
                raise ValueError(f"{part.label}: {e}") from None
        os.fsync(out_fd)
        return Summary(count, os.fstat(out_fd).st_size)
    finally:
        for _, reader, _, _ in readers:
            reader.close()


def _merged_header(readers: list[tuple[Part, Any, dict[str, Any], int]],
                   metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The output's header: every source's entries in file order, offsets moved by the data
    of the sources before it."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    base = 0
    for part, _, entries, length in readers:
        for name, info in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            out_name = part.prefix + name
            if out_name in header:
                raise ValueError(f"{part.label}: tensor {out_name!r} is in another source too")
            start, stop = info["data_offsets"]
            header[out_name] = {"dtype": info["dtype"], "shape": info["shape"],
                                "data_offsets": [base + start, base + stop]}
        base += length
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw, len(header) - bool(metadata)


def _write(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        n = os.write(fd, view)
        view = view[n:]
