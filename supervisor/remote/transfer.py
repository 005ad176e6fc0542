"""Moving one checkpoint to or from a mirror, each file hashed on the way (store.py's contract).

Upload: every file the local manifest lists, `parallel` at a time, each hashed while it is sent
and compared with the manifest (`CorruptLocal`: nothing of a damaged checkpoint is committed);
then manifest.json, byte for byte the local one. Download: the local commit protocol, into a
temp dir renamed into place when every file matched (`CorruptRemote` otherwise), with files
already here (a local checkpoint, the blob cache) linked instead of fetched, and hashed too.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import filemode
from supervisor.ckpt import hashing, layout, safeio
from supervisor.ckpt import manifest as mf
from supervisor.ckpt.commit import fsync_dir
from supervisor.ckpt.verify import Level, check_member_name, verify
from supervisor.remote import cache as blobs
from supervisor.remote.errors import CorruptLocal, CorruptRemote, MirrorError

if TYPE_CHECKING:
    from supervisor.remote.store import Mirror

CHUNK = 8 << 20
"""Bytes read or written per call while streaming (one buffer per file in flight)."""
MIN_PART = 32 << 20
"""Smallest multipart part. S3 allows 10,000 parts an object, so a file gets
max(MIN_PART, size / 9000) parts (rounded to MiB): 32 MiB parts reach 280 GiB, larger files
get larger parts. Memory: one part buffer per parallel upload (4 x 32 MiB by default)."""


@dataclass(frozen=True)
class Transfer:
    name: str
    bytes: int
    """Bytes sent or received over the network."""
    seconds: float
    files: int
    """Files sent or received over the network."""
    cached_bytes: int = 0
    """Bytes a download took from local blobs (cache or checkpoints) instead."""


def upload(mirror: Mirror, local: Path, *, parallel: int = 4) -> Transfer:
    """Upload the committed checkpoint dir `local`: every file its manifest lists, hashed
    while sent, `parallel` at a time; then manifest.json. An unfinished remote copy is
    overwritten; an identical committed one is left as it is (0 bytes sent); a different
    committed one (the run rolled back and saved that step again) is decommitted first,
    so no reader ever sees its manifest beside the new files."""
    t0 = time.monotonic()
    local = Path(local)
    name = local.name
    mirror._step(name)
    try:
        raw = safeio.read_limited(local / layout.MANIFEST, mf.MAX_BYTES)
        m = mf.parse(raw)
        alg = hashing.manifest_alg(m, None)
        files = [(check_member_name(local, member), member, entry)
                 for member, entry in m["files"].items()]
    except FileNotFoundError:
        raise CorruptLocal(name, "no manifest.json (the save did not finish)") from None
    except (mf.ManifestError, hashing.HashAlgError) as e:
        raise CorruptLocal(name, str(e)) from None
    except OSError as e:
        raise CorruptLocal(name, f"cannot read manifest.json: {e.strerror or e}") from None
    if _remote_manifest_is(mirror, name, raw):
        return Transfer(name, 0, time.monotonic() - t0, 0)
    mirror._rm(mirror._path(name, layout.MANIFEST), f"cannot decommit {name}")
    sent = _run_all(parallel, [
        (_put, (mirror, src, name, member, entry, alg)) for src, member, entry in files])
    try:
        mirror.fs.pipe_file(mirror._path(name, layout.MANIFEST), raw)
    except Exception as e:
        raise mirror._error(f"cannot write {name}/manifest.json", e) from None
    mirror._sync(mirror._path(name, layout.MANIFEST), directory=True)
    return Transfer(name, sum(sent) + len(raw), time.monotonic() - t0, len(files) + 1)


def _remote_manifest_is(mirror: Mirror, name: str, raw: bytes) -> bool:
    try:
        return mirror.read_manifest_bytes(name) == raw
    except CorruptRemote:
        return False


def _put(mirror: Mirror, src: Path, name: str, member: str, entry: dict, alg: str) -> int:
    size = entry["size"]
    dest = mirror._path(name, member)
    h = hashing.new_hasher(alg)
    n = 0
    try:
        f = safeio.open_regular(src, follow_symlinks=True, buffering=0)
    except FileNotFoundError:
        raise CorruptLocal(name, f"{member}: missing") from None
    except OSError as e:
        raise CorruptLocal(name, f"{member}: {e.strerror or e}") from None
    with f:
        if (actual := os.fstat(f.fileno()).st_size) != size:
            raise CorruptLocal(name, f"{member}: has {actual} bytes, the manifest says "
                               f"{size} (truncated or rewritten)")
        part = max(MIN_PART, -(-size // 9000) + (1 << 20) - 1 >> 20 << 20)
        buf = bytearray(max(1, min(CHUNK, size)))
        view = memoryview(buf)
        try:
            with mirror.fs.open(dest, "wb", block_size=part) as out:
                while k := f.readinto(buf):
                    h.update(view[:k])
                    out.write(view[:k])
                    n += k
        except Exception as e:
            raise mirror._error(f"cannot write {name}/{member}", e) from None
    if n != size or h.hexdigest() != entry["hash"]:
        # Sent already (a stream cannot be taken back): remove it; without the manifest
        # the remote directory is an unfinished upload either way.
        mirror._rm(dest, f"cannot remove {name}/{member}")
        raise CorruptLocal(name, f"{member}: hash mismatch (changed since the save: the "
                           "local checkpoint is damaged)")
    mirror._sync(dest)
    return n


def download(mirror: Mirror, name: str, ckpt_dir: Path, *, key: bytes | None = None,
             cache: blobs.BlobCache | None = None, file_mode: int = 0o600,
             parallel: int = 4) -> Transfer:
    """Download `name` into `ckpt_dir/name` by the local commit protocol. Files whose
    content is already here (a local checkpoint or `cache`) are linked or copied instead;
    every file is hashed either way. A `checkpoint-<step>` already in `ckpt_dir` that
    verifies is kept (nothing replaced)."""
    t0 = time.monotonic()
    step = mirror._step(name)
    raw = mirror.read_manifest_bytes(name)
    m = mirror._parse(name, raw)
    try:
        mf.check_signature(m, key)
        alg = hashing.manifest_alg(m, key)
    except (mf.ManifestError, hashing.HashAlgError) as e:
        raise CorruptRemote(name, f"manifest.json: {e}") from None
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / name
    total = sum(e["size"] for e in m["files"].values())
    if os.path.lexists(final):
        _keep_existing(final, key)
        return Transfer(name, 0, time.monotonic() - t0, 0, cached_bytes=total)
    filemode.make_dir(ckpt_dir, file_mode)
    sources = blobs.local_blobs(ckpt_dir)
    tmp = ckpt_dir / layout.tmp_name(step)
    os.mkdir(tmp, 0o700)  # nobody else looks in while it is written
    try:
        try:
            members = [(check_member_name(tmp, member), member, entry)
                       for member, entry in m["files"].items()]
        except mf.ManifestError as e:
            raise CorruptRemote(name, str(e)) from None
        got = _run_all(parallel, [
            (_fetch, (mirror, dest, name, member, entry, alg, sources, cache))
            for dest, member, entry in members])
        fd = os.open(tmp / layout.MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        filemode.apply_tree(tmp, file_mode)
        fsync_dir(tmp)
        if os.path.lexists(final):  # another process downloaded it meanwhile
            _keep_existing(final, key)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, final)
            fsync_dir(ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    net = [n for n, _ in got]
    return Transfer(name, sum(net) + len(raw), time.monotonic() - t0,
                    sum(1 for n in net if n) + 1, cached_bytes=sum(c for _, c in got))


def _keep_existing(final: Path, key: bytes | None) -> None:
    v = verify(final, Level.FULL, key)
    if not v.ok:
        raise MirrorError(f"{final.name} is already in {final.parent} and fails "
                          f"verification ({v.reason}): move it away to download the "
                          "mirror's copy")


def _fetch(mirror: Mirror, dest: Path, name: str, member: str, entry: dict, alg: str,
           sources: dict[tuple[str, str], Path],
           cache: blobs.BlobCache | None) -> tuple[int, int]:
    """Put one file at `dest`, checked; returns (bytes downloaded, bytes from local)."""
    size, want = entry["size"], entry["hash"]
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    here = sources.get((alg, want))
    for get in ((lambda: here is not None and blobs.place(here, dest)),
                (lambda: cache is not None and cache.get(alg, want, dest))):
        if get():
            try:
                ok = (os.stat(dest).st_size == size
                      and hashing.hash_file(dest, alg) == want)
            except OSError:
                ok = False
            if ok:
                if cache is not None:
                    cache.add(alg, want, dest)
                return 0, size
            dest.unlink(missing_ok=True)  # a damaged blob: fetch the real bytes
    h = hashing.new_hasher(alg)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        def sink(chunk: bytes) -> None:
            h.update(chunk)
            out.write(chunk)

        n = mirror._stream(name, member, size, sink)
        out.flush()
        os.fsync(out.fileno())
    if n != size:
        raise CorruptRemote(name, f"{member}: has {n if n <= size else 'more'} bytes, the "
                            f"manifest says {size} (truncated or rewritten)")
    if h.hexdigest() != want:
        raise CorruptRemote(name, f"{member}: hash mismatch (the mirror's bytes differ "
                            "from its manifest)")
    if cache is not None:
        cache.add(alg, want, dest)
    return n, 0


def _run_all(parallel: int, calls: list[tuple[Any, tuple]]) -> list:
    """Results of `fn(*args)` for each call, `parallel` at a time; the first error is raised
    after cancelling what has not started."""
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(calls)))) as pool:
        futures = [pool.submit(fn, *args) for fn, args in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
