"""Blobs already on this machine, found by content hash, so a download fetches only new bytes.

Two sources, both keyed by `(hash_alg, hash)` as a manifest lists a file:

- `BlobCache`: a directory `<root>/<alg>/<hash>` of files kept from earlier downloads, capped at
  `max_bytes` with least-recently-used eviction (a hit refreshes the entry's mtime). The default
  root is `$RTRAIN_CACHE_DIR`, else `~/.cache/rtrain/blobs`; directories are 0700 and files 0600
  (checkpoints may hold private weights).
- `local_blobs(ckpt_dir)`: the files of the committed checkpoints already in `ckpt_dir`, from
  their manifests. A shard unchanged since the last checkpoint (frozen weights, a dataset
  index) is never downloaded again.

A blob is only a candidate: the downloader hashes what it placed and fetches the file when the
hash differs, so a damaged cache costs time, never a bad checkpoint.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint import safeio
from rtrain.checkpoint.hashing import BLAKE3, XXH3
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import check_name

ENV_CACHE_DIR = "RTRAIN_CACHE_DIR"
"""Where files downloaded from a mirror are cached by content hash (default
~/.cache/rtrain/blobs), so a resume does not download them again."""
DEFAULT_MAX_BYTES = 20 << 30
"""20 GiB: a few checkpoints of a mid-sized model; set `max_bytes` for more."""

_HASH_RE = re.compile(r"^[0-9a-f]{16,128}$")
_ALGS = (XXH3, BLAKE3)


def default_root(env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get(ENV_CACHE_DIR):
        return Path(env[ENV_CACHE_DIR])
    return Path.home() / ".cache" / "rtrain" / "blobs"


def place(src: Path, dest: Path) -> bool:
    """Put `src`'s bytes at `dest` (which must not exist): a hard link where the filesystem
    allows, else a copy. False when `src` cannot be read (gone since it was listed)."""
    try:
        os.link(src, dest)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    try:
        # A FIFO or device under a checkpoint's file name must not hang the copy.
        with safeio.open_regular(src, follow_symlinks=True) as fin:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as fout:
                shutil.copyfileobj(fin, fout, 8 << 20)
        return True
    except (FileNotFoundError, safeio.UnsafeFile):
        return False


def local_blobs(ckpt_dir: str | os.PathLike) -> dict[tuple[str, str], Path]:
    """`(alg, hash) -> path` for every file of the committed checkpoints in `ckpt_dir` whose
    manifest reads; a checkpoint whose manifest does not is skipped (it is no source)."""
    found: dict[tuple[str, str], Path] = {}
    for _, path in list_checkpoints(ckpt_dir):
        try:
            m = mf.load(path)
        except mf.ManifestError:
            continue
        alg = m.get("hash_alg", XXH3)
        for name, entry in m["files"].items():
            try:
                check_name(name)
            except mf.ManifestError:
                continue  # a hostile manifest cannot point the downloader outside `ckpt_dir`
            found.setdefault((alg, entry["hash"]), path / name)
    return found


class BlobCache:
    """Content-addressed files under `root`, at most `max_bytes` in all (LRU)."""

    def __init__(self, root: Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.max_bytes = max_bytes

    def _path(self, alg: str, hash: str) -> Path | None:
        # Keys come from a remote manifest: only known algorithms and hex digests name a file.
        if alg not in _ALGS or not _HASH_RE.match(hash):
            return None
        return self.root / alg / hash

    def get(self, alg: str, hash: str, dest: Path) -> bool:
        """Place the blob at `dest` if present; True when placed."""
        path = self._path(alg, hash)
        if path is None or not place(path, dest):
            return False
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return True

    def add(self, alg: str, hash: str, path: Path) -> None:
        """Keep `path`'s bytes under `(alg, hash)`; the caller has checked the hash. Entries
        beyond `max_bytes` are evicted, oldest use first. A file larger than the whole cache
        is not kept."""
        target = self._path(alg, hash)
        if target is None or target.exists():
            return
        try:
            if os.stat(path).st_size > self.max_bytes:
                return
            self._make_dirs(target.parent)
            tmp = target.with_name(f".{hash}.{os.getpid()}.{os.urandom(4).hex()}")
            if not place(path, tmp):
                return
            os.chmod(tmp, 0o600, follow_symlinks=False)
            os.replace(tmp, target)  # a concurrent adder of the same blob wrote the same bytes
        except OSError:
            return  # a cache that cannot be written is only slower, never an error
        self.evict()

    def _make_dirs(self, d: Path) -> None:
        for p in (self.root, d):
            if not p.is_dir():
                p.mkdir(parents=True, exist_ok=True)
                os.chmod(p, 0o700)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every blob, oldest use first."""
        out = []
        for alg in _ALGS:
            try:
                with os.scandir(self.root / alg) as it:
                    for e in it:
                        if e.name.startswith(".") or not e.is_file(follow_symlinks=False):
                            continue
                        st = e.stat(follow_symlinks=False)
                        out.append((st.st_mtime, st.st_size, Path(e.path)))
            except FileNotFoundError:
                continue
        out.sort()
        return out

    def evict(self) -> None:
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        for _, size, path in entries:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            total -= size
