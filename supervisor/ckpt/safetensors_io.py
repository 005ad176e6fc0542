"""Write safetensors files straight from tensor memory, hashing on the way; read headers.

Why not `safetensors.torch.save_file`: it copies every tensor into a bytes object first, does
not fsync, and would need a second pass to hash. This writer streams each buffer to the file
once, feeds the same memory to xxh3, and fsyncs. The files it writes are plain safetensors
(8-byte little-endian header length, JSON header padded to 8 bytes, then the data), which the
`safetensors` library reads (that is how the worker loads them, without pickle).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from supervisor.ckpt.hashing import new_hasher

MAX_HEADER = 100 << 20
_MAX_WRITE = 1 << 30


@dataclass(frozen=True)
class TensorBlob:
    """One tensor as bytes: safetensors dtype code ("F32"), shape, a C-contiguous buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True)
class Written:
    size: int
    hash: str


def build_header(blobs: list[TensorBlob], metadata: dict[str, str] | None = None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for b in blobs:
        n = b.data.nbytes
        header[b.name] = {
            "dtype": b.dtype,
            "shape": list(b.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_all(fd: int, view: memoryview, hasher) -> None:
    hasher.update(view)
    while view.nbytes:
        n = os.write(fd, view[:_MAX_WRITE])
        view = view[n:]


def write_file(
    path: str | os.PathLike,
    blobs: Iterable[TensorBlob],
    metadata: dict[str, str] | None = None,
    fsync: bool = True,
) -> Written:
    """Write one safetensors file; returns its size and xxh3-128 content hash."""
    blobs = list(blobs)
    hasher = new_hasher()
    header = build_header(blobs, metadata)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(header), hasher)
        for b in blobs:
            data = b.data if b.data.format == "B" and b.data.ndim == 1 else b.data.cast("B")
            _write_all(fd, data, hasher)
        if fsync:
            os.fsync(fd)
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return Written(size=size, hash=hasher.hexdigest())


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size. Raises ValueError."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} does not fit in a file of {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"header is not valid JSON ({e})") from None
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = max(end, info["data_offsets"][1])
    if 8 + n + end != size:
        raise ValueError(f"header describes {8 + n + end} bytes but the file has {size}")
    return header
