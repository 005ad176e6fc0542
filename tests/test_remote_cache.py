"""The blob cache of downloads (supervisor/mirror/cache.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from conftest import build_checkpoint

from rtrain.checkpoint.hashing import XXH3, hash_file
from rtrain.checkpoint.manifest import load
from rtrain.supervisor.mirror.cache import BlobCache, default_root, local_blobs

H1, H2, H3 = "1" * 32, "2" * 32, "3" * 32


def blob(tmp_path: Path, name: str, size: int) -> Path:
    p = tmp_path / name
    p.write_bytes(os.urandom(size))
    return p


def test_add_then_get_places_the_bytes_privately(tmp_path):
    cache = BlobCache(tmp_path / "cache")
    src = blob(tmp_path, "a", 100)
    cache.add(XXH3, H1, src)
    assert cache.get(XXH3, H1, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == src.read_bytes()
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "cache" / XXH3).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "cache" / XXH3 / H1).st_mode) == 0o600
    assert not cache.get(XXH3, H2, tmp_path / "other")


def test_least_recently_used_blobs_go_first(tmp_path):
    cache = BlobCache(tmp_path / "cache", max_bytes=250)
    for i, h in enumerate((H1, H2)):
        cache.add(XXH3, h, blob(tmp_path, h, 100))
        os.utime(tmp_path / "cache" / XXH3 / h, (1000 + i, 1000 + i))
    assert cache.get(XXH3, H1, tmp_path / "use")  # H1 now the most recently used
    cache.add(XXH3, H3, blob(tmp_path, H3, 100))
    assert sorted(p.name for _, _, p in cache.entries()) == sorted([H1, H3])


def test_a_file_larger_than_the_cache_is_not_kept(tmp_path):
    cache = BlobCache(tmp_path / "cache", max_bytes=10)
    cache.add(XXH3, H1, blob(tmp_path, "big", 100))
    assert cache.entries() == []


def test_keys_from_a_remote_manifest_never_name_a_path(tmp_path):
    cache = BlobCache(tmp_path / "cache")
    src = blob(tmp_path, "a", 10)
    for alg, h in ((XXH3, "../../escape"), ("sha1/../..", H1), (XXH3, "")):
        cache.add(alg, h, src)
        assert not cache.get(alg, h, tmp_path / "out")
    assert not (tmp_path / "escape").exists() and cache.entries() == []


def test_default_root():
    assert default_root({"RTRAIN_CACHE_DIR": "/c"}) == Path("/c")
    assert default_root({}) == Path.home() / ".cache" / "rtrain" / "blobs"


def test_local_checkpoints_are_a_source(tmp_path):
    ckpt = build_checkpoint(tmp_path / "ckpts", 100, files={"frozen.bin": b"x" * 50})
    m = load(ckpt)
    found = local_blobs(tmp_path / "ckpts")
    assert found[(XXH3, m["files"]["frozen.bin"]["hash"])] == ckpt / "frozen.bin"
    assert hash_file(ckpt / "frozen.bin") == m["files"]["frozen.bin"]["hash"]
    assert local_blobs(tmp_path / "missing") == {}
