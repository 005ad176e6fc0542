"""Committing a memory-tier snapshot to the checkpoint dir: rtrain's copy, byte for byte.

The snapshot is copied as it is (its manifest, signature and encryption stay valid: they cover
these very bytes), each file hashed as it is read and compared with the manifest before the
commit, so a snapshot torn or changed in memory is refused, never committed. The copy goes
into a temp dir past the page cache (checkpoint/direct_copy.py: it runs beside the training,
and costs it a quarter of a cached write's CPU), is fsynced file by file, and is renamed into
place like any commit. A step
the checkpoint dir already holds is left alone (the worker's own save of it came first).

While it copies, rtrain holds hard links to the snapshot's files in a pin dir of its own: the
worker removes its older snapshot once a newer one commits (double buffering), and the pin
keeps the pages readable until the copy is done.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from rtrain.checkpoint import direct_copy, parts, safeio
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.commit import fsync_dir
from rtrain.checkpoint.hashing import hash_mapped, new_hasher
from rtrain.checkpoint.layout import MANIFEST, checkpoint_name, tmp_name
from rtrain.checkpoint.verify import Verdict
from rtrain.supervisor.core import filemode


class SnapshotRefused(Exception):
    """The snapshot does not match its manifest (the message says which file and how)."""


@dataclass(frozen=True)
class Persisted:
    path: Path
    bytes: int
    already: bool = False
    """The checkpoint dir held the step already: nothing was copied."""


def persist(snap: Verdict, ckpt_dir: Path, *, fsync: bool = True,
            mode: int = filemode.DEFAULT_FILE_MODE) -> Persisted:
    """Commit `snap` (its manifest checked) into `ckpt_dir`. Raises SnapshotRefused, or
    OSError when the checkpoint dir cannot take it (nothing is left behind either way)."""
    m = snap.manifest
    assert m is not None
    final = ckpt_dir / checkpoint_name(snap.step)
    if os.path.lexists(final):
        return Persisted(final, 0, already=True)
    pin = _pin(snap.path)
    try:
        if mf.load(pin) != m:
            raise SnapshotRefused("its manifest changed after it was checked")
        return _commit(dict.fromkeys(m["files"], pin), m, None, pin, snap.step, ckpt_dir,
                       fsync, mode)
    finally:
        shutil.rmtree(pin, ignore_errors=True)


def persist_group(group: list[parts.Part], ckpt_dir: Path, key: bytes | None, *,
                  fsync: bool = True, mode: int = filemode.DEFAULT_FILE_MODE) -> Persisted:
    """Commit the parts of one whole step of a process group (checkpoint/parts.py) as
    the disk checkpoint a collective save writes: every part's files, each hashed as copied
    against its part's manifest, under one manifest (`parts.group_manifest`) that rtrain signs
    with the run's key. Raises SnapshotRefused, or OSError."""
    try:
        m = parts.group_manifest([p.manifest for p in group])
    except parts.NotOneStep as e:
        raise SnapshotRefused(str(e)) from None
    if key is not None:
        mf.sign_manifest(m, key)
    final = ckpt_dir / checkpoint_name(m["step"])
    if os.path.lexists(final):
        return Persisted(final, 0, already=True)
    pins: list[Path] = []
    try:
        sources: dict[str, Path] = {}
        for p in group:
            pins.append(_pin(p.path))
            if mf.load(pins[-1]) != p.manifest:
                raise SnapshotRefused(f"rank {p.rank}'s manifest changed after it was checked")
            sources.update(dict.fromkeys(p.manifest["files"], pins[-1]))
        return _commit(sources, m, mf.dumps(m), None, m["step"], ckpt_dir, fsync, mode)
    finally:
        for pin in pins:
            shutil.rmtree(pin, ignore_errors=True)


def _commit(sources: dict[str, Path], m: dict, manifest: bytes | None, manifest_dir: Path | None,
            step: int, ckpt_dir: Path, fsync: bool, mode: int) -> Persisted:
    """Copy every file of `m` from its pinned source dir into a temp dir, checked; the
    manifest (`manifest` bytes, or copied from `manifest_dir`); rename into place."""
    final = ckpt_dir / checkpoint_name(step)
    tmp = ckpt_dir / tmp_name(step)
    try:
        filemode.make_dir(ckpt_dir, mode)
        os.mkdir(tmp, 0o700)
        copied = 0
        for name, entry in m["files"].items():
            copied += _copy_checked(sources[name], name, entry, m["hash_alg"], tmp, fsync)
        if manifest is None:
            assert manifest_dir is not None
            _copy_checked(manifest_dir, MANIFEST, None, m["hash_alg"], tmp, fsync)
        else:
            with open(tmp / MANIFEST, "xb") as f:
                f.write(manifest)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        filemode.apply_tree(tmp, mode)
        if fsync:
            fsync_dir(tmp)
        if os.path.lexists(final):
            shutil.rmtree(tmp, ignore_errors=True)
            return Persisted(final, 0, already=True)
        os.rename(tmp, final)
        if fsync:
            fsync_dir(ckpt_dir)
        return Persisted(final, copied)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_content(snap: Verdict) -> None:
    """Hash every file of `snap` in place and compare it with the manifest, as `persist` does as
    it copies: for a relaunch that reads the snapshot (unhashed) before that copy is made.
    Raises SnapshotRefused, naming the file."""
    m = snap.manifest
    assert m is not None
    for name, entry in m["files"].items():
        path = snap.path / name
        try:
            size = os.lstat(path).st_size
            digest = hash_mapped(path, m["hash_alg"]) if size == entry.get("size") else ""
        except (OSError, ValueError) as e:
            raise SnapshotRefused(f"{name}: {e}") from None
        _matches(name, size, digest, entry)


def make_durable(path: Path) -> None:
    """fsync a checkpoint committed without it (`persist(fsync=False)`): each file, its dir,
    and the checkpoint dir that holds it."""
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)
    fsync_dir(path.parent)


def link_files(src: Path, dst: Path) -> None:
    """A new owner-only dir `dst` holding hard links to `src`'s files: the same pages, kept
    readable whatever removes `src` meanwhile. Raises OSError (FileNotFoundError: `src`, or
    one of its files, went first); `dst` may then be left for the caller to remove."""
    os.mkdir(dst, 0o700)
    for entry in os.scandir(src):
        if entry.is_file(follow_symlinks=False):
            os.link(entry.path, dst / entry.name, follow_symlinks=False)


def _pin(snapshot: Path) -> Path:
    """Hard links to the snapshot's files, in a dir of rtrain's beside it."""
    pin = snapshot.parent / f".pin-{snapshot.name}-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        link_files(snapshot, pin)
    except FileNotFoundError:
        shutil.rmtree(pin, ignore_errors=True)
        raise SnapshotRefused("it was removed while rtrain took it (a newer one replaced "
                              "it)") from None
    except BaseException:
        shutil.rmtree(pin, ignore_errors=True)
        raise
    return pin


def _copy_checked(src_dir: Path, name: str, entry: dict | None, alg: str, dst_dir: Path,
                  fsync: bool) -> int:
    """Copy one file, hashing what is read; compare with the manifest's entry (None: the
    manifest itself, compared as the caller did)."""
    h = new_hasher(alg)
    try:
        src = safeio.open_beneath(src_dir, name, buffering=0)
    except (FileNotFoundError, safeio.UnsafeFile) as e:
        raise SnapshotRefused(f"{name}: {e}") from None
    dst_path = dst_dir / name
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    with src:
        size = direct_copy.copy_hashed(src, dst_path, h, fsync=fsync)
    if entry is not None:
        _matches(name, size, h.hexdigest(), entry)
    return size


def _matches(name: str, size: int, digest: str, entry: dict) -> None:
    """Raises SnapshotRefused unless `name`'s size and content hash are its manifest entry's."""
    if size != entry.get("size") or digest != entry.get("hash"):
        raise SnapshotRefused(f"{name} does not match its manifest "
                              f"({'size' if size != entry.get('size') else 'content hash'})")
