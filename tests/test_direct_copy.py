"""checkpoint/direct_copy.py: a copy past the page cache is the source, byte for byte, hashed
as written, whatever the source's size and however short its reads; and O_DIRECT is used where
the filesystem takes it (the point of it)."""

from __future__ import annotations

import os
import threading

import pytest
import xxhash

from rtrain.checkpoint import direct_copy


def _copy(src_path, dst, **kw) -> tuple[int, str]:
    h = xxhash.xxh3_64()
    with open(src_path, "rb", buffering=0) as src:
        n = direct_copy.copy_hashed(src, dst, h, **kw)
    return n, h.hexdigest()


@pytest.mark.parametrize("size", [0, 1, direct_copy.BLOCK, direct_copy.BLOCK * 3 + 17,
                                  direct_copy.CHUNK * 2 + 4095])
def test_the_copy_is_the_source_and_its_hash(tmp_path, size):
    data = os.urandom(size)
    (tmp_path / "src").write_bytes(data)
    n, digest = _copy(tmp_path / "src", tmp_path / "dst")
    assert n == size
    assert (tmp_path / "dst").read_bytes() == data
    assert digest == xxhash.xxh3_64(data).hexdigest()
    assert (tmp_path / "dst").stat().st_mode & 0o777 == 0o600


def test_short_reads_leave_the_aligned_path_and_still_copy_everything(tmp_path):
    """A pipe returns what was written, a few KiB at a time: the first unaligned read moves
    the copy to the page cache for the rest, without losing or doubling a byte."""
    data = os.urandom(3 * direct_copy.BLOCK * 50 + 333)
    r, w = os.pipe()

    def feed() -> None:
        with os.fdopen(w, "wb", buffering=0) as out:
            for off in range(0, len(data), 5000):
                out.write(data[off:off + 5000])

    t = threading.Thread(target=feed)
    t.start()
    h = xxhash.xxh3_64()
    with os.fdopen(r, "rb", buffering=0) as src:
        n = direct_copy.copy_hashed(src, tmp_path / "dst", h)
    t.join()
    assert n == len(data)
    assert (tmp_path / "dst").read_bytes() == data
    assert h.hexdigest() == xxhash.xxh3_64(data).hexdigest()


def test_an_existing_destination_is_never_overwritten(tmp_path):
    (tmp_path / "src").write_bytes(b"new")
    (tmp_path / "dst").write_bytes(b"good checkpoint")
    with pytest.raises(FileExistsError):
        _copy(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == b"good checkpoint"


def test_whole_blocks_go_past_the_page_cache_where_the_filesystem_allows(tmp_path, monkeypatch):
    """What the copy is for: the file's whole blocks written with O_DIRECT, the tail after
    clearing it. Counted at the write calls, with the flag read back from the descriptor."""
    try:
        fd, direct = direct_copy._create(tmp_path / "probe")
        os.close(fd)
    except OSError:
        direct = False
    if not direct:
        pytest.skip("this filesystem refuses O_DIRECT")
    writes: list[tuple[int, bool]] = []
    real = os.write

    def spy(fd, data):
        import fcntl
        writes.append((len(data), bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)))
        return real(fd, data)

    monkeypatch.setattr(direct_copy.os, "write", spy)
    size = direct_copy.CHUNK + direct_copy.BLOCK * 2 + 100
    (tmp_path / "src").write_bytes(os.urandom(size))
    _copy(tmp_path / "src", tmp_path / "dst")
    direct_bytes = sum(n for n, d in writes if d)
    assert direct_bytes == size - 100
    assert [n for n, d in writes if not d] == [100]
