"""The memory tier's files, reused: each snapshot is written into the files of the snapshot
before the one it replaces, mapped once for the process's life.

Why. A snapshot written into new files paid the kernel for every 4 KiB page twice: found,
zeroed and mapped as the file was written, freed when the older snapshot went; and the hash
read the file back. For the 126 MiB of a 10.5M-parameter model with AdamW that was about 65 of
the writer's 100 ms of CPU time a snapshot, taken from the training on a machine whose cores
the step keeps busy (docs/benchmarks.md). Into a file whose pages exist and are mapped, a
snapshot is one memmove per chunk (the GIL released) and the hash of that chunk while it is in
cache: 9 + 5 ms.

What makes a file reusable (`retire`, `take`):
- it is one this process created and still maps (the inode is checked at each reuse), never
  one an earlier attempt left (a restore may have mapped that one copy-on-write);
- the snapshot holding it is older than the newest `kept` and was renamed out of the committed
  names first (`layout.trash_name`: never read as a snapshot), so no reader finds it from then
  on;
- after that rename, nothing else links it (`st_nlink == 1`): rtrain pins the snapshot it
  persists with hard links (supervisor/memtier/persist.py), and a pinned file is left to
  rtrain, unmapped, and a new file made in its place. A pin that comes after the rename fails
  on the missing name and rtrain refuses that snapshot, as it did when older snapshots were
  deleted.
Each file is hashed from the bytes just written into it, before the manifest commits, so a
file that changed under the copy would fail the manifest's check at any restore or persist.

An earlier attempt's files are reused too (`adopt`): its retired spares, and its snapshots
once this process committed a newer one (they were deleted then). A relaunch otherwise made
every file new twice over (its first snapshots, then the live state's files: live.py), 80 ms
for 126 MiB where an existing file takes 22 (mapped with its pages populated at once), on the
steps right after each relaunch. Such a file is taken only when it is safe to write: renamed
out of the committed names first, a regular file of this user that nothing else links, and
not mapped by this process (the restore maps the snapshot it reads copy-on-write: writing into
that file would change the tensors that still share its pages). Another process that maps one
(rtrain hashing it in place) would read a changed file and refuse it by its manifest, as with
this process's own spares.

A new file's pages are allocated up front (`posix_fallocate`): a shared-memory filesystem that
is full fails the snapshot with ENOSPC, as a write did, instead of a SIGBUS at the first store
into a page that cannot be had.

Not used for encrypted snapshots (the encryption writes its own stream) nor for a rank's part
under torchrun (rtrain's peer server reads the parts it serves without pinning them): those are
written into new files as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from rtrain.checkpoint.hashing import new_hasher
from rtrain.checkpoint.layout import TRASH_PREFIX, trash_name
from rtrain.checkpoint.safetensors_io import Written

CHUNK = 1 << 20  # copied, then hashed while it is still in the core's cache


@dataclass
class ShmFile:
    """One file in shared memory, mapped writable for as long as this process may reuse it."""

    path: Path
    fd: int
    ino: int
    size: int
    map: mmap.mmap
    base: int  # the mapping's address

    def release(self) -> None:
        """Unmap and close; the file itself stays where it is (a committed snapshot's)."""
        self.map.close()
        os.close(self.fd)


def create(path: Path, size: int) -> ShmFile:
    """A new file of `size` bytes at `path`, its pages allocated, mapped. Raises OSError
    (ENOSPC: the filesystem cannot hold it), leaving no file behind."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        m = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return _shm_file(path, fd, os.fstat(fd).st_ino, m)


def _shm_file(path: Path, fd: int, ino: int, m: mmap.mmap) -> ShmFile:
    return ShmFile(path, fd, ino, len(m), m, ctypes.addressof(ctypes.c_char.from_buffer(m)))


def open_existing(path: Path, mapped: set[tuple[int, int]],
                  populate: bool = True) -> ShmFile | None:
    """An existing file at `path` mapped writable (its pages populated at once with
    `populate`), when it is safe to write (module docstring): a regular file of this user, one
    link, not in `mapped` ((st_dev, st_ino) of what this process maps). None otherwise, the
    file left as it is."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.getuid()
                or st.st_size == 0 or (st.st_dev, st.st_ino) in mapped):
            os.close(fd)
            return None
        m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0))
    except (OSError, ValueError):
        os.close(fd)
        return None
    return _shm_file(path, fd, st.st_ino, m)


# An existing file's page tables filled in one call: 12-16 ms for 126 MiB here, against 33-37
# ms of faults taken one page at a time by the first copy into it.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def mapped_files() -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file this process maps (/proc/self/maps)."""
    out: set[tuple[int, int]] = set()
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or fields[4] == b"0":
            continue
        major, _, minor = fields[3].partition(b":")
        try:
            out.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
        except ValueError:
            continue
    return out


def fill(f: ShmFile, header: bytes, tensors: Iterable[torch.Tensor], hash_alg: str,
         check: Callable[[], None] | None = None) -> Written:
    """Write a safetensors file into `f`: `header` (safetensors_io.build_header), then each
    tensor's bytes in order (CPU, contiguous, as the header lists them), each chunk hashed
    right after it is copied. The copy runs without the GIL (ctypes.memmove), beside the step.
    `check` runs before each chunk (it raises to stop: the snapshot was abandoned)."""
    hasher = new_hasher(hash_alg)
    with memoryview(f.map) as view:
        view[:len(header)] = header
        hasher.update(view[:len(header)])
        pos = len(header)
        for t in tensors:
            n = t.numel() * t.element_size()
            if pos + n > f.size:
                raise ValueError(f"{f.path.name}: the tensors do not fit the header's size")
            src = t.data_ptr()
            for off in range(0, n, CHUNK):
                if check is not None:
                    check()
                k = min(CHUNK, n - off)
                ctypes.memmove(f.base + pos, src + off, k)
                hasher.update(view[pos:pos + k])
                pos += k
        if pos != f.size:
            raise ValueError(f"{f.path.name}: {pos} bytes written into a file of {f.size}")
    return Written(size=f.size, hash=hasher.hexdigest())


class ShmFiles:
    """The files of this process's committed snapshots, and the spares retired ones left."""

    def __init__(self) -> None:
        self._held: dict[Path, dict[str, ShmFile]] = {}  # committed snapshot -> its files
        # file name -> retired snapshots' files, newest last; at most `max_spares` each: two
        # while the live state may still take one (live.py), one for the snapshots after it.
        self._spares: dict[str, list[ShmFile]] = {}
        self.max_spares = 2
        self._pending: dict[str, ShmFile] = {}  # the snapshot being written
        # Files made new so far: a snapshot that made one paid the kernel for every page of
        # it, once, and its cost is not what the next ones cost (memory_tier.py's pacing).
        self.created = 0
        # The writer thread takes and retires files; the training thread takes the live
        # state's (take_spare) at the boundary where it adopts, beside a snapshot maybe.
        self._lock = threading.Lock()

    def take(self, tmp: Path, name: str, size: int) -> ShmFile:
        """The file `name` of the snapshot being written in `tmp`: a spare of that size moved
        there, else a new one."""
        f = self.take_spare(tmp / name, size)
        if f is None:
            f = create(tmp / name, size)
            self.created += 1
        self._pending[name] = f
        return f

    def _pop(self, name: str) -> ShmFile | None:
        with self._lock:
            spares = self._spares.get(name)
            return spares.pop() if spares else None

    def _keep(self, name: str, f: ShmFile) -> None:
        """`f` a spare under `name`; the oldest beyond `max_spares` goes."""
        with self._lock:
            spares = self._spares.setdefault(name, [])
            spares.append(f)
            extra = spares[:-self.max_spares]
            del spares[:-self.max_spares]
        for old in extra:
            _discard(old)

    def limit(self, n: int) -> None:
        """At most `n` spares of each name from now on (the oldest go now)."""
        with self._lock:
            self.max_spares = n
            extra = [f for spares in self._spares.values() for f in spares[:-n]]
            for spares in self._spares.values():
                del spares[:-n]
        for old in extra:
            _discard(old)

    def take_spare(self, path: Path, size: int) -> ShmFile | None:
        """A spare of `size` bytes under `path`'s name moved to `path`, or None (a spare of
        another size, or no longer safe to write, is discarded)."""
        spare = self._pop(path.name)
        if spare is None:
            return None
        if spare.size == size and _move(spare, path):
            return spare
        _discard(spare)
        return None

    def adopt(self, directory: Path, populate: bool = True) -> None:
        """Take the files of an earlier attempt's `directory` (a retired snapshot's, trash-named,
        or a committed one this process replaced, renamed out of the committed names here
        first) as spares where safe (module docstring); the rest goes, as a deletion would.
        `populate=False` on the training thread: the writer's first copy faults the pages in."""
        if not directory.name.startswith(TRASH_PREFIX):
            aside = directory.parent / trash_name(directory.name)
            try:
                os.rename(directory, aside)
            except OSError:
                return  # rtrain took it away meanwhile
            directory = aside
        mapped = mapped_files()
        try:
            names = os.listdir(directory)
        except OSError:
            return
        kept = False
        for name in names:
            with self._lock:
                wanted = (name.endswith(".safetensors")
                          and len(self._spares.get(name, ())) < self.max_spares)
            f = open_existing(directory / name, mapped, populate) if wanted else None
            if f is not None:
                self._keep(name, f)
                kept = True
            else:
                _unlink(directory / name)
        if not kept:
            _unlink(directory)

    def committed(self, path: Path) -> None:
        """The snapshot being written committed as `path`: its files are held there."""
        for name, f in self._pending.items():
            f.path = path / name
        self._held[path] = self._pending
        self._pending = {}

    def aborted(self) -> None:
        """The snapshot being written failed: its files go (their dir is removed)."""
        for f in self._pending.values():
            f.release()
        self._pending = {}

    def abandoned(self, tmp: Path) -> None:
        """The snapshot being written in `tmp` was abandoned before its copy was done: its
        files, whose bytes may mix two steps, become spares again (the next snapshot writes
        every byte of them), in `tmp` renamed out of the temp names first so no sweep or
        reader takes it for a snapshot in progress."""
        aside = tmp.parent / trash_name(tmp.name)
        try:
            os.rename(tmp, aside)
        except OSError:
            self.aborted()
            return
        for name, f in self._pending.items():
            f.path = aside / name
            self._keep(name, f)
        self._pending = {}

    def retire(self, snapshot: Path) -> bool:
        """Take `snapshot` (one of ours, older than the newest) out of the committed names and
        keep its files as spares; False when it is not ours (the caller removes it)."""
        files = self._held.pop(snapshot, None)
        if files is None:
            return False
        aside = snapshot.parent / trash_name(snapshot.name)
        try:
            os.rename(snapshot, aside)
        except OSError:  # rtrain removed it (dropped, refused): nothing to reuse
            for f in files.values():
                f.release()
            return True
        kept = set()
        for name, f in files.items():
            f.path = aside / name
            if _unshared(f):
                self._keep(name, f)
                kept.add(name)
            else:
                f.release()  # pinned by rtrain: its pages are rtrain's until it unpins
        for entry in os.scandir(aside):  # the manifest, state.json, a pinned file: gone
            if entry.name not in kept:
                _unlink(Path(entry.path))
        if not kept:
            _unlink(aside)
        return True

    def close(self) -> None:
        """Unmap everything; spares are deleted, committed snapshots stay."""
        for f in self._pending.values():
            f.release()
        for files in self._held.values():
            for f in files.values():
                f.release()
        for spares in self._spares.values():
            for f in spares:
                _discard(f)
        self._pending, self._held, self._spares = {}, {}, {}

    @property
    def spare_bytes(self) -> int:
        with self._lock:
            return sum(f.size for spares in self._spares.values() for f in spares)

    @property
    def held(self) -> bool:
        """Whether any file is mapped."""
        return bool(self._held or self._spares or self._pending)


def _move(f: ShmFile, dest: Path) -> bool:
    """Rename a spare into the snapshot being written; False unless it is still the file this
    process maps and nothing else links it (the caller discards it then)."""
    old_dir = f.path.parent
    try:
        os.rename(f.path, dest)
    except OSError:
        return False
    f.path = dest
    try:
        os.rmdir(old_dir)  # the retired snapshot's dir, once its last spare left it
    except OSError:
        pass
    return _unshared(f)


def _unshared(f: ShmFile) -> bool:
    """The name is the inode we map, and no other name links it."""
    try:
        st = os.stat(f.path, follow_symlinks=False)
    except OSError:
        return False
    return st.st_ino == f.ino and st.st_nlink == 1 and os.fstat(f.fd).st_nlink == 1


def _discard(f: ShmFile) -> None:
    """A spare that will not be used: unmapped and deleted (with its retired dir, once empty;
    never a snapshot's dir: a spare lives in a trash-named one until it is moved)."""
    f.release()
    _unlink(f.path)
    if f.path.parent.name.startswith(TRASH_PREFIX):
        try:
            os.rmdir(f.path.parent)
        except OSError:
            pass


def _unlink(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except OSError:
        pass
