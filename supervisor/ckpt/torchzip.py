"""Check a `torch.save` file without unpickling it.

Since torch 1.6 `torch.save` writes a zip archive (`<name>/data.pkl`, `<name>/data/0`, ...,
every member stored uncompressed with its CRC-32). `quick` checks the zip structure: the
central directory, a `data.pkl` member, every member's local header and data inside the file.
`full` also streams every member and compares its CRC-32 with the stored one. Nothing is ever
unpickled: the pickle is data we only checksum.

Files in the legacy format (a bare pickle stream, `_use_new_zipfile_serialization=False`) hold no
checksums; they pass with a note saying so.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import TYPE_CHECKING

from supervisor.ckpt import safeio

if TYPE_CHECKING:
    import zipfile

_CHUNK = 8 << 20
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zipfile's structFileHeader
_LOCAL_MAGIC = b"PK\x03\x04"
# A legacy torch.save file starts with a pickle of the magic number at protocol 2.
_PICKLE_PROTO2 = b"\x80\x02"


class TorchFileError(ValueError):
    """The file is not a readable torch.save archive; `str()` is the reason a person reads."""


def check(path: str | os.PathLike, *, full: bool) -> str:
    """Raise `TorchFileError` with the reason if `path` is damaged; else return a note ("" or
    why there was nothing to check)."""
    import zipfile  # here, not at the top: `rtrain inspect` over rtrain's own format never needs it

    # Links are the caller's to check; a FIFO or device is refused here, never opened.
    with safeio.open_regular(path, follow_symlinks=True) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise TorchFileError("empty file")
        head = f.read(4)
        if head != _LOCAL_MAGIC:
            if head[:2] == _PICKLE_PROTO2:
                return "legacy (non-zip) torch.save format: holds no checksums to verify"
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
            if not any(i.filename.endswith("/data.pkl") or i.filename == "data.pkl"
                       for i in infos):
                raise TorchFileError("zip archive without data.pkl: not a torch.save file")
            for info in infos:
                _check_bounds(f, info, size)
            if full:
                for info in infos:
                    _check_crc(f, info)
    return ""


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
