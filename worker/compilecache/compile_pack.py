"""The `compile-cache.bin` container: torch's portable artifacts and the compiled kernels.

torch's mega-cache (`torch.compiler.save_cache_artifacts`) holds the compiled graphs, but on a
CPU not the C++ kernels they load: a fresh node with only the mega-cache still runs the C
compiler for every kernel (measured: 15.4 s of a 19.7 s cold first step for a one-layer
model). The kernels live in inductor's cache dir, one folder per two-character hash prefix,
each file named by the hash of its source and build command; a kernel found there is loaded
instead of built. So the container holds both:

    b"rtrain-compile-cache 1\\n"
    then entries, each: u16 name length, name (UTF-8), u64 size, the bytes
    names: "torch" (the mega-cache bytes, as torch wrote them) and
           "inductor/<prefix>/<file>" (a file of inductor's cache dir)

Parsing is bounded (sizes checked against what is left, names against a strict pattern that
leaves no way out of the cache dir); nothing here runs anything. Whether the bytes may be used
at all is compile_cache.judge's decision.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"rtrain-compile-cache 1\n"
TORCH = "torch"
# A kernel file: inductor/<two-char prefix>/<name>. No "..", no separators past the prefix.
_KERNEL = re.compile(r"inductor/([a-z0-9_]{2})/([A-Za-z0-9_][A-Za-z0-9_.-]{0,200})")
_HEAD = struct.Struct("<H")
_SIZE = struct.Struct("<Q")


class PackError(ValueError):
    """The container is not one this version reads; str() says why."""


def pack(torch_bytes: bytes, kernels: dict[str, bytes]) -> bytes:
    """The container of the mega-cache bytes and kernel files (name -> bytes)."""
    out = [MAGIC]
    for name, data in [(TORCH, torch_bytes), *sorted(kernels.items())]:
        raw = name.encode()
        out += [_HEAD.pack(len(raw)), raw, _SIZE.pack(len(data)), data]
    return b"".join(out)


def unpack(data: bytes) -> tuple[bytes, dict[str, bytes]]:
    """(mega-cache bytes, kernel files by name); PackError when malformed."""
    if not data.startswith(MAGIC):
        raise PackError("it does not start with rtrain's compile-cache header")
    view, pos = memoryview(data), len(MAGIC)
    torch_bytes: bytes | None = None
    kernels: dict[str, bytes] = {}
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            raise PackError("an entry is cut short")
        (n,) = _HEAD.unpack_from(data, pos)
        pos += _HEAD.size
        if pos + n + _SIZE.size > len(data):
            raise PackError("an entry is cut short")
        try:
            name = bytes(view[pos:pos + n]).decode()
        except UnicodeDecodeError:
            raise PackError("an entry's name is not UTF-8") from None
        pos += n
        (size,) = _SIZE.unpack_from(data, pos)
        pos += _SIZE.size
        if size > len(data) - pos:
            raise PackError(f"entry {name!r} claims more bytes than the file holds")
        body = bytes(view[pos:pos + size])
        pos += size
        if name == TORCH and torch_bytes is None:
            torch_bytes = body
        elif _KERNEL.fullmatch(name) and name not in kernels:
            kernels[name] = body
        else:
            raise PackError(f"entry {name[:80]!r} is not a name rtrain writes")
    if torch_bytes is None:
        raise PackError("it holds no torch artifacts")
    return torch_bytes, kernels


def kernel_files(cache_dir: Path) -> Iterator[tuple[str, Path]]:
    """inductor's kernel files under `cache_dir` (its two-character prefix folders), as
    (container name, path); links, locks and folders of other kinds are left out."""
    try:
        prefixes = sorted(os.scandir(cache_dir), key=lambda e: e.name)
    except OSError:
        return
    for d in prefixes:
        if len(d.name) != 2 or not d.is_dir(follow_symlinks=False):
            continue
        try:
            files = sorted(os.scandir(d.path), key=lambda e: e.name)
        except OSError:
            continue
        for f in files:
            name = f"inductor/{d.name}/{f.name}"
            if (f.is_file(follow_symlinks=False) and _KERNEL.fullmatch(name)
                    and not f.name.endswith((".lock", ".tmp"))):
                yield name, Path(f.path)


def place(cache_dir: Path, kernels: dict[str, bytes]) -> int:
    """Write the kernel files into `cache_dir` where inductor looks for them; a file already
    there is kept (it is the same build: the name is the hash of its source and command).
    Each appears whole (temp file, rename). Returns how many were written."""
    written = 0
    for name, data in kernels.items():
        m = _KERNEL.fullmatch(name)
        if m is None:  # unpack admits none, but never write a name not checked here
            continue
        folder = cache_dir / m.group(1)
        target = folder / m.group(2)
        if os.path.lexists(target):
            continue
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rtrain-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o700 if name.endswith(".so") else 0o600)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        written += 1
    return written

