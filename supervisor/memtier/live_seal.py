"""Sealing the live state into a committed snapshot, once the process that wrote it is gone.

The worker keeps its parameters and optimizer state in mapped files in `<memory dir>/live/` and
marks the directory whole at each step boundary (worker/memtier/live.py): `mark.json` exists
exactly while the files hold one step. Nothing is hashed while training, so the files are not a
snapshot yet. When the attempt ends (a SIGKILL, a segfault, the OOM killer: no Python ran),
rtrain makes them one, here: the files are moved into a temp dir, the tied names' bytes filled
from the slot they share, each file hashed, and the manifest written (signed under a key) and
committed as `checkpoint-<step>` beside the worker's own snapshots. From there it is the newest
snapshot like any other: committed to the checkpoint dir, resumed from, verified as read.

Never sealed: a directory without a mark (the process died inside the optimizer's step or the
boundary's writes: the state may mix two steps), one whose writer is still alive, one whose step
the writer's own snapshot holds, one whose files are not the sizes its layout lists. A snapshot
of the same step from an earlier timeline (before a rollback) is replaced, newer ones removed.
A directory not sealed is removed, and the newest snapshot or disk save is the fallback, as it
was before the live state existed.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from rtrain.checkpoint import hashing
from rtrain.checkpoint.commit import PendingCheckpoint, remove_dir
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.protocol import LIVE_DIR, LIVE_LAYOUT, LIVE_MARK

STATE, EXTRA = "state.json", "extra.safetensors"
MARK_LIMIT = 16 << 20  # bytes: the manifest's fields and the extras' names
LAYOUT_LIMIT = 64 << 20  # bytes: every tensor's name, dtype and shape
CHUNK = 8 << 20


class NotSealed(Exception):
    """Why the live directory is not a snapshot (it is removed)."""


@dataclass(frozen=True)
class Sealed:
    step: int
    path: Path
    bytes: int


def seal(memory_dir: Path, key: bytes | None, disk_newest: int | None = None) -> Sealed | None:
    """Commit the live state of `memory_dir` as a snapshot when it holds a whole step newer than
    the checkpoint dir's newest (`disk_newest`: a save at the failure may hold it already);
    None otherwise. The live directory is gone afterwards either way,
    unless its writer is still running. Raises NotSealed with the reason for a marked directory
    that could not be sealed (removed too)."""
    live = memory_dir / LIVE_DIR
    try:
        st = os.lstat(live)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return None  # not the worker's: never read, never removed
    try:
        layout = _read_json(live / LIVE_LAYOUT, LAYOUT_LIMIT)
        mark = _read_json(live / LIVE_MARK, MARK_LIMIT)
    except FileNotFoundError:
        layout = mark = None
    except (OSError, ownfiles.RefusedFile, ValueError) as e:
        layout, mark = None, {"unreadable": str(e)}
    writer = (mark or layout or {}).get("pid")
    if _alive(writer):
        return None  # still writing: a launch found another rtrain's run, or a stray writer
    if layout is None or mark is None:
        _remove(live)  # killed inside the optimizer's step or the boundary's writes
        return None
    try:
        if "unreadable" in mark:
            raise NotSealed(f"its mark or layout does not read: {mark['unreadable']}")
        return _seal(memory_dir, live, mark, layout, key, disk_newest)
    finally:
        _remove(live)


def _seal(memory_dir: Path, live: Path, mark: dict[str, Any], layout: dict[str, Any],
          key: bytes | None, disk_newest: int | None) -> Sealed | None:
    step, fields = mark.get("step"), mark.get("fields")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise NotSealed(f"its mark names no step ({step!r})")
    if disk_newest is not None and step <= disk_newest:
        return None  # nothing the disk lacks (as decide.worth_persisting)
    if not isinstance(fields, dict):
        raise NotSealed("its mark holds no manifest fields")
    found = list_checkpoints(memory_dir)
    if mark.get("snapshot") == step and any(s == step for s, _ in found):
        return None  # the writer's own snapshot of this step holds it, hashed as written
    files = layout.get("files")
    tied = layout.get("tied") if isinstance(layout.get("tied"), dict) else {}
    extra = mark.get("extra") if isinstance(mark.get("extra"), dict) else {}
    if not isinstance(files, dict) or not files:
        raise NotSealed("its layout lists no files")
    pending = PendingCheckpoint(memory_dir, step, fsync=False, hash_alg=hashing.alg_for(key))
    pending.generation = mark.get("generation") or None
    total = 0
    try:
        listed: list[tuple[str, int | None, dict[str, Any] | None]] = [
            (name, _size(entry), entry.get("tensors")) for name, entry in files.items()]
        listed += [(EXTRA, None, extra), (STATE, None, None)]
        for name, size, tensors in listed:
            if "/" in name or name.startswith("."):
                raise NotSealed(f"its layout names {name!r}")
            dest = pending.tmp / name
            _take(live / name, dest, size)
            for src, dst, n in _ranges(tied.get(name, [])):
                _copy_range(dest, src, dst, n)
            nbytes = dest.stat().st_size
            total += nbytes
            pending.add_file(name, nbytes, hashing.hash_mapped(dest, pending.hash_alg),
                             tensors if isinstance(tensors, dict) else None)
        path = pending.commit(fields, key)  # over an earlier timeline's of this step
    except BaseException:
        pending.abort()
        raise
    # Newer snapshots are an earlier timeline's (the writer's own are never newer than its
    # last boundary): steps beyond a rollback, never to be resumed from again.
    for s, p in list_checkpoints(memory_dir):
        if s > step:
            remove_dir(p)
    return Sealed(step, path, total)


def _take(src: Path, dest: Path, size: int | None) -> None:
    """Move one of the live files into the temp dir, checked: a regular file of this user, of
    the size the layout lists."""
    try:
        st = os.lstat(src)
    except FileNotFoundError:
        raise NotSealed(f"{src.name} is missing") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise NotSealed(f"{src.name} is not a regular file of this user")
    if size is not None and st.st_size != size:
        raise NotSealed(f"{src.name} holds {st.st_size} bytes, its layout says {size}")
    os.rename(src, dest)


def _copy_range(path: Path, src: int, dst: int, n: int) -> None:
    """A tied name's bytes: those of the slot it shares (the worker kept one copy)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if min(src, dst) < 0 or max(src, dst) + n > size:
            raise NotSealed(f"{path.name}: a tied range lies outside the file")
        for off in range(0, n, CHUNK):
            k = min(CHUNK, n - off)
            os.pwrite(fd, os.pread(fd, k, src + off), dst + off)
    finally:
        os.close(fd)


def _ranges(value: Any) -> list[tuple[int, int, int]]:
    out = []
    for r in value if isinstance(value, list) else []:
        if (not isinstance(r, list) or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise NotSealed(f"its layout's tied range {r!r} is not three offsets")
        out.append((r[0], r[1], r[2]))
    return out


def _size(entry: Any) -> int:
    size = entry.get("size") if isinstance(entry, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise NotSealed(f"its layout lists a file without a size ({entry!r:.80})")
    return size


def _read_json(path: Path, limit: int) -> dict[str, Any]:
    obj = json.loads(ownfiles.read_own(path, limit=limit))
    if not isinstance(obj, dict):
        raise ValueError(f"{path.name} is not a JSON object")
    return obj


def _alive(pid: Any) -> bool:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
