"""Check a `torch.save` file without unpickling it.

Since torch 1.6 `torch.save` writes a zip archive (`<name>/data.pkl`, `<name>/data/0`, ...,
every member stored uncompressed with its CRC-32). `quick` checks the zip structure: the
central directory, a `data.pkl` member, every member's local header and data inside the file.
`full` also streams every member and compares its CRC-32 with the stored one. Nothing is ever
unpickled: the pickle is data we only checksum.

Both levels also walk the opcodes of the pickle (`pickle_scan`): a pickle that names anything
beyond what checkpoints hold (its allow-list) is refused, and the step it holds (`iter_num`,
`global_step`, ...) is read for a file whose name states none. Sizes are bounded before
anything is read: a `data.pkl` over `MAX_PICKLE`, or a compressed member that would expand far
beyond its stored bytes (a zip bomb; torch never compresses), is refused with the reason.

Files in the legacy format (a bare pickle stream, `_use_new_zipfile_serialization=False`) hold no
checksums; they pass with a note saying so, after the same walk of their pickles.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtrain.checkpoint import safeio
from rtrain.supervisor.ckpt import pickle_scan

if TYPE_CHECKING:
    import zipfile

_CHUNK = 8 << 20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zipfile's structFileHeader
_LOCAL_MAGIC = b"PK\x03\x04"
# A legacy torch.save file starts with a pickle of the magic number at protocol 2.
_PICKLE_PROTO2 = b"\x80\x02"
# torch keeps tensors out of the pickle, so even a checkpoint of a million tensors has a
# data.pkl of tens of MiB; walking more would take minutes of the supervisor's time.
MAX_PICKLE = 64 << 20
# A compressed member may expand to this many times its stored size (and at least _BOMB_FLOOR).
_BOMB_RATIO = 100
_BOMB_FLOOR = 64 << 20
_CACHE_SIZE = 64
_cache: dict[tuple, Checked] = {}


class TorchFileError(ValueError):
    """The file is not a readable torch.save archive; `str()` is the reason a person reads."""


@dataclass(frozen=True)
class Checked:
    note: str  # "" or why there was less to check (the legacy format)
    step: int | None  # the step the pickle holds (pickle_scan.STEP_KEYS), if any
    step_key: str | None


def check(path: str | os.PathLike, *, full: bool, any_global: bool = False) -> str:
    """Raise `TorchFileError` with the reason if `path` is damaged; else return a note ("" or
    why there was nothing to check). `any_global`: the pickle's globals are not judged
    (`pickle_scan.scan`), for a file no resume loads."""
    return inspect(path, full=full, any_global=any_global).note


def inspect(path: str | os.PathLike, *, full: bool, any_global: bool = False) -> Checked:
    """`check`, and the step the pickle holds. A file checked before with the same inode, size
    and mtime is not read again (listing and resume selection ask several times an attempt)."""
    # Links are the caller's to check; a FIFO or device is refused here, never opened.
    with safeio.open_regular(path, follow_symlinks=True) as f:
        st = os.fstat(f.fileno())
        key = (os.fspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, full,
               any_global)
        hit = _cache.get(key)
        if hit is not None:
            return hit
        out = _inspect_open(f, st.st_size, full=full, any_global=any_global)
    if len(_cache) >= _CACHE_SIZE:
        _cache.pop(next(iter(_cache)))
    _cache[key] = out
    return out


def _inspect_open(f, size: int, *, full: bool, any_global: bool = False) -> Checked:
    import zipfile  # here, not at the top: `rtrain inspect` over rtrain's own format never needs it

    if size == 0:
        raise TorchFileError("empty file")
    head = f.read(4)
    if head != _LOCAL_MAGIC:
        if head[:2] == _PICKLE_PROTO2:
            f.seek(0)
            scan = _scan_legacy(f, size, any_global)
            return Checked("legacy (non-zip) torch.save format: holds no checksums to verify",
                           scan.step, scan.step_key)
        raise TorchFileError("neither a zip archive nor a torch.save pickle "
                             f"(starts with {head!r})")
    try:
        zf = zipfile.ZipFile(f)
    except zipfile.BadZipFile as e:
        raise TorchFileError(f"zip structure unreadable, truncated? ({e})") from None
    except (ValueError, EOFError) as e:  # zipfile's own bounds checks on a cut archive
        raise TorchFileError(f"zip structure unreadable, truncated? ({e})") from None
    with zf:
        infos = zf.infolist()
        pkl = [i for i in infos
               if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if not pkl:
            raise TorchFileError("zip archive without data.pkl: not a torch.save file")
        for info in infos:
            _check_bounds(f, info, size)
            _check_expansion(info)
        if full:
            for info in infos:
                _check_crc(f, info)
        scan = _scan_member(zf, pkl[0], any_global)
    return Checked("", scan.step, scan.step_key)


def _check_expansion(info: zipfile.ZipInfo) -> None:
    """Refuse a member that would expand far beyond its stored bytes (a zip bomb)."""
    limit = max(_BOMB_FLOOR, info.compress_size * _BOMB_RATIO)
    if info.file_size > limit:
        raise TorchFileError(f"member {info.filename!r} would expand to {info.file_size} bytes "
                             f"from {info.compress_size} (a zip bomb? refused)")


def _scan_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo,
                 any_global: bool = False) -> pickle_scan.Scan:
    """Read data.pkl (at most MAX_PICKLE bytes, whatever its header claims) and walk it."""
    import zipfile

    if info.file_size > MAX_PICKLE:
        raise TorchFileError(f"{info.filename!r} is {info.file_size} bytes, more than rtrain "
                             f"reads of a pickle ({MAX_PICKLE >> 20} MiB); refused")
    try:
        with zf.open(info) as member:
            raw = member.read(MAX_PICKLE + 1)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as e:
        raise TorchFileError(f"member {info.filename!r}: {e}") from None
    if len(raw) > MAX_PICKLE:
        raise TorchFileError(f"{info.filename!r} expands past {MAX_PICKLE >> 20} MiB; refused")
    try:
        return pickle_scan.scan(raw, what=info.filename.rsplit("/", 1)[-1],
                                any_global=any_global)
    except pickle_scan.PickleRefused as e:
        raise TorchFileError(str(e)) from None


def _scan_legacy(f, size: int, any_global: bool = False) -> pickle_scan.Scan:
    """A legacy file is four pickles (magic number, protocol, system info, the object) then
    raw storage bytes: walk the four, the step is the object's."""
    raw = f.read(min(size, MAX_PICKLE))
    stream = io.BytesIO(raw)
    scan = None
    try:
        for what in ("magic number", "protocol", "system info", "object"):
            scan = pickle_scan.scan(stream, what=f"legacy pickle ({what})",
                                    any_global=any_global)
    except pickle_scan.PickleRefused as e:
        raise TorchFileError(str(e)) from None
    assert scan is not None
    return scan


def _check_bounds(f, info: zipfile.ZipInfo, size: int) -> None:
    """The member's local header is where the central directory says and its data fits."""
    if not 0 <= info.header_offset < size:
        raise TorchFileError(f"member {info.filename!r}: header offset {info.header_offset} "
                             f"outside the file (bytes cut or moved)")
    f.seek(info.header_offset)
    raw = f.read(_LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size:
        raise TorchFileError(f"member {info.filename!r}: local header past the end of the "
                             f"file (truncated)")
    fields = _LOCAL_HEADER.unpack(raw)
    if fields[0] != _LOCAL_MAGIC:
        raise TorchFileError(f"member {info.filename!r}: no local header at offset "
                             f"{info.header_offset} (bytes moved or cut)")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.compress_size > size:
        raise TorchFileError(f"member {info.filename!r}: data runs past the end of the file "
                             f"({start + info.compress_size} > {size} bytes, truncated)")


def _check_crc(f, info: zipfile.ZipInfo) -> None:
    import zipfile

    if info.compress_type != zipfile.ZIP_STORED:
        # torch never compresses; a compressed member goes through zipfile, which checks CRCs.
        with zipfile.ZipFile(f) as zf, zf.open(info) as member:
            try:
                while member.read(_CHUNK):
                    pass
            except (zipfile.BadZipFile, zlib.error, EOFError) as e:
                raise TorchFileError(f"member {info.filename!r}: {e}") from None
        return
    f.seek(info.header_offset)
    fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    f.seek(info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10])
    crc, left = 0, info.compress_size
    buf = bytearray(min(_CHUNK, max(left, 1)))
    view = memoryview(buf)
    while left:
        n = f.readinto(view[:min(left, len(buf))])
        if not n:
            raise TorchFileError(f"member {info.filename!r}: data cut short (truncated)")
        crc = zlib.crc32(view[:n], crc)
        left -= n
    if crc != info.CRC:
        raise TorchFileError(f"member {info.filename!r}: CRC-32 {crc:08x} does not match the "
                             f"stored {info.CRC:08x} (bytes changed on disk)")
