"""Moving one checkpoint between a local directory and a mirror, checked byte for byte.

Uploads hash every local file just before the backend's put sends it and refuse a file that
differs from the local manifest (`CorruptLocal`); manifest.json goes last, the commit marker.
Downloads fetch with the backend's get into a temp dir, hash the bytes on disk and rename into
place only when every file matches (`CorruptRemote` otherwise), exactly like a local commit;
bytes already here (a local checkpoint, the blob cache) are linked or copied instead of fetched.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rtrain.checkpoint import hashing, layout, runid, safeio
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.commit import fsync_dir
from rtrain.checkpoint.verify import Level, check_member_name, check_name, verify
from rtrain.supervisor.core import filemode
from rtrain.supervisor.mirror import cache as blobs
from rtrain.supervisor.mirror.mirror_errors import (
    CorruptLocal,
    CorruptRemote,
    MirrorError,
    OtherRun,
)

if TYPE_CHECKING:
    from rtrain.supervisor.mirror.store import Mirror

CHUNK = 8 << 20
"""Bytes read or written per call while hashing or streaming (one buffer per file in flight)."""
PART_BYTES: int | None = None
"""Multipart part size handed to the backend's put_file; None: its own choice (s3fs: 50 MiB
parts, more for files past 500 GiB to stay within S3's 10,000 parts; a file of twice the
part size or more goes in parts, 10 at a time)."""


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


# -- upload -------------------------------------------------------------------------------


def upload(mirror: Mirror, local: Path, *, parallel: int = 4, resend: bool = False) -> Transfer:
    """`Mirror.upload`: the committed checkpoint dir `local`, file by file, then manifest.json.
    Nothing is read through a link (`safeio.open_beneath`), a manifest whose step is not the
    name's is refused, and a committed remote copy of another run is never replaced."""
    t0 = time.monotonic()
    local = Path(local)
    name = local.name
    step = mirror.step_of(name)
    try:
        with safeio.open_beneath(local, layout.MANIFEST) as f:
            raw = f.read(mf.MAX_BYTES + 1)
        if len(raw) > mf.MAX_BYTES:
            raise CorruptLocal(name, f"manifest.json is larger than {mf.MAX_BYTES >> 20} MiB")
        m = mf.parse(raw)
        if m["step"] != step:
            raise CorruptLocal(name, f"its manifest says step {m['step']}: a copy under "
                               "another name")
        alg = hashing.manifest_alg(m, None)
        for member in m["files"]:
            check_name(member)
    except FileNotFoundError:
        raise CorruptLocal(name, "no manifest.json (the save did not finish)") from None
    except safeio.UnsafeFile as e:
        raise CorruptLocal(name, _unsafe(local, e)) from None
    except (mf.ManifestError, hashing.HashAlgError) as e:
        raise CorruptLocal(name, str(e)) from None
    except OSError as e:
        raise CorruptLocal(name, f"cannot read manifest.json: {e.strerror or e}") from None
    there = _remote_manifest(mirror, name)
    if there == raw and not resend:
        return Transfer(name, 0, time.monotonic() - t0, 0)
    if there is not None:
        _refuse_other_run(mirror, name, there, runid.of(m))
    mirror.remove(mirror.path(name, layout.MANIFEST), f"cannot decommit {name}")
    if mirror.local:  # private before the first byte lands in it
        filemode.make_dir(Path(mirror.path(name)), mirror.file_mode)
    sent = _run_all(parallel, [
        (_put, (mirror, local, name, member, entry, alg)) for member, entry in m["files"].items()])
    try:
        mirror.fs.pipe_file(mirror.path(name, layout.MANIFEST), raw)
    except Exception as e:
        raise mirror.error(f"cannot write {name}/manifest.json", e) from None
    if mirror.local:
        filemode.apply_tree(Path(mirror.path(name)), mirror.file_mode)
    _sync(mirror, mirror.path(name, layout.MANIFEST), directory=True)
    return Transfer(name, sum(sent) + len(raw), time.monotonic() - t0, len(m["files"]) + 1)


def _unsafe(local: Path, e: safeio.UnsafeFile) -> str:
    """`UnsafeFile`'s reason with the path inside the checkpoint (the dir itself: 'is ...')."""
    where = os.path.relpath(e.filename, local) if e.filename else "."
    return e.strerror if where == "." else f"{where} {e.strerror}"


def _remote_manifest(mirror: Mirror, name: str) -> bytes | None:
    """The remote manifest's bytes; None when there is none (or it is unreadable as one)."""
    try:
        return mirror.read_manifest_bytes(name)
    except CorruptRemote:
        return None


def _refuse_other_run(mirror: Mirror, name: str, there: bytes, ours: str | None) -> None:
    """A committed remote `name` of another run (an earlier run under the same URL) is that
    run's checkpoint: replacing it would lose it. One that does not parse is nobody's."""
    try:
        theirs = runid.of(mf.parse(there))
    except mf.ManifestError:
        return
    if theirs != ours:
        raise OtherRun(name, f"the mirror's {name} belongs to another run "
                       f"({runid.whose(theirs)}): not replaced (give this run a prefix of its "
                       "own)")


def _put(mirror: Mirror, local: Path, name: str, member: str, entry: dict, alg: str) -> int:
    size = entry["size"]
    dest = mirror.path(name, member)
    h = hashing.new_hasher(alg)
    n = 0
    try:
        f = safeio.open_beneath(local, member, buffering=0)
    except FileNotFoundError:
        raise CorruptLocal(name, f"{member}: missing") from None
    except safeio.UnsafeFile as e:
        raise CorruptLocal(name, _unsafe(local, e)) from None
    except OSError as e:
        raise CorruptLocal(name, f"{member}: {e.strerror or e}") from None
    with f:
        if (actual := os.fstat(f.fileno()).st_size) != size:
            raise CorruptLocal(name, f"{member}: has {actual} bytes, the manifest says "
                               f"{size} (truncated or rewritten)")
        buf = bytearray(max(1, min(CHUNK, size)))
        view = memoryview(buf)
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
        if n != size or h.hexdigest() != entry["hash"]:
            raise CorruptLocal(name, f"{member}: hash mismatch (changed since the save: the "
                               "local checkpoint is damaged)")
        # Hashed just before it is sent (from the page cache, at memory speed), then handed to
        # the backend's own put, which sends large files in concurrent parts: streaming our
        # reads through a write handle sent the parts one by one, at 0.6x a plain put. The put
        # opens the file we hashed (through our descriptor), not whatever the name is now.
        try:
            mirror.fs.put_file(_by_descriptor(f.fileno(), local / member), dest,
                               **({} if mirror.local or PART_BYTES is None
                                  else {"chunksize": PART_BYTES}))
        except Exception as e:
            raise mirror.error(f"cannot write {name}/{member}", e) from None
    _sync(mirror, dest)
    return n


def _by_descriptor(fd: int, path: Path) -> str:
    """A name that opens the file behind `fd` (Linux's /proc), else the path itself."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else str(path)


def _sync(mirror: Mirror, path: str, *, directory: bool = False) -> None:
    """On a filesystem mirror, what was written reaches the disk before the manifest."""
    if not mirror.local:
        return
    fd = os.open(os.path.dirname(path) if directory else path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- download -----------------------------------------------------------------------------


def download(mirror: Mirror, name: str, ckpt_dir: Path, *, key: bytes | None = None,
             cache: blobs.BlobCache | None = None, file_mode: int = 0o600,
             parallel: int = 4) -> Transfer:
    """`Mirror.download`: `name` into `ckpt_dir/name` by the local commit protocol."""
    t0 = time.monotonic()
    step = mirror.step_of(name)
    raw = mirror.read_manifest_bytes(name)
    m = mirror.parse_manifest(name, raw)
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
    remote = mirror.path(name, member)
    try:
        if mirror.local:  # a FIFO or device under a listed name: never opened (get would)
            safeio.check_regular(remote, follow_symlinks=True)
        n = mirror.fs.size(remote)
    except FileNotFoundError:
        raise CorruptRemote(name, f"{member}: missing") from None
    except safeio.UnsafeFile as e:
        raise CorruptRemote(name, f"{member} {e.strerror}") from None
    except Exception as e:
        raise mirror.error(f"cannot read {name}/{member}", e) from None
    if n != size:  # checked first: a mirror cannot make us fill the disk
        raise CorruptRemote(name, f"{member}: has {n} bytes, the manifest says {size} "
                            "(truncated or rewritten)")
    # The backend's own get (one streamed request; concurrent parts where it has them),
    # then the bytes that landed on disk are hashed from the page cache and compared: what
    # is verified is exactly what the resume will read. Streaming our own reads through a
    # hasher made one ranged request per chunk, at half a plain get's rate.
    try:
        mirror.fs.get_file(remote, str(dest))
    except FileNotFoundError:
        raise CorruptRemote(name, f"{member}: missing") from None
    except Exception as e:
        raise mirror.error(f"cannot read {name}/{member}", e) from None
    filemode.set_mode(dest, 0o600)
    with safeio.open_regular(dest, buffering=0) as f:
        h = hashing.new_hasher(alg)
        got = 0
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        while k := f.readinto(buf):
            h.update(view[:k])
            got += k
        os.fsync(f.fileno())
    if got != size:
        raise CorruptRemote(name, f"{member}: has {got} bytes, the manifest says {size} "
                            "(truncated or rewritten)")
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
