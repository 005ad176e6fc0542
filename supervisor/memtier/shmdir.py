"""The memory tier's directory: where it is, creating it owner-only, reading its snapshots.

One directory per checkpoint dir and user, `<root>/rtrain-<uid>-<16 hex digits of the checkpoint
dir's resolved path>`, root /dev/shm (RTRAIN_SHM_ROOT elsewhere): every launch of a run finds
the snapshots an earlier one left, and two runs never share one. It is created 0700 and must be
a directory of this user, not a link: another user's planted directory is refused (the tier
stays off for the run, said once). It holds committed snapshots `checkpoint-<step>` (written by
the worker, worker/memtier/memory_tier.py), the worker's temp dirs, the run identity `.rtrain-run`
(copied from the checkpoint dir so each snapshot's manifest names the run) and, after rtrain
dropped the tier, `dropped`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

from rtrain.checkpoint import parts, runid
from rtrain.checkpoint.commit import remove_dir
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, Verdict, verify
from rtrain.supervisor.core.protocol import MEMORY_DROPPED

ENV_SHM_ROOT = "RTRAIN_SHM_ROOT"
"""Where the memory tier makes its directory instead of /dev/shm: a tmpfs elsewhere, where
/dev/shm is small or missing (containers)."""
SHM_ROOT = "/dev/shm"


class Unusable(Exception):
    """The directory cannot hold the tier (the message says why and what to change)."""


def path_for(ckpt_dir: Path, env: dict[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    root = Path(env.get(ENV_SHM_ROOT) or SHM_ROOT)
    key = hashlib.sha256(str(Path(ckpt_dir).resolve()).encode()).hexdigest()[:16]
    return root / f"rtrain-{os.getuid()}-{key}"


def prepare(path: Path, run: str | None) -> None:
    """Create the directory (or check the one there), copy the run identity, clear `dropped`.
    Raises Unusable."""
    if not path.parent.is_dir():
        raise Unusable(f"{path.parent} does not exist: no shared memory to hold snapshots "
                       f"(set {ENV_SHM_ROOT} to a tmpfs)")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise Unusable(f"cannot create {path}: {e.strerror}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise Unusable(f"{path} is not a directory of this user: remove it, or set "
                       f"{ENV_SHM_ROOT}")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    if run is not None and runid.read(path) != run:
        runid.write(path, run)
    try:
        os.unlink(path / MEMORY_DROPPED)
    except FileNotFoundError:
        pass


def newest(path: Path, key: bytes | None) -> tuple[Verdict | None, list[Verdict]]:
    """The newest snapshot whose manifest checks (quick: manifest, signature, names, sizes;
    the content is hashed as it is copied or loaded), and the newer ones that did not."""
    refused: list[Verdict] = []
    if not _own_dir(path):
        return None, refused
    for _, p in list_checkpoints(path):
        v = verify(p, Level.QUICK, key)
        if v.ok:
            return v, refused
        refused.append(v)
    return None, refused


def drop(path: Path) -> int:
    """Stop the tier (memory pressure): `dropped` tells the worker to take no more snapshots;
    the snapshots are removed. Returns the bytes freed."""
    if not _own_dir(path):
        return 0
    with open(path / MEMORY_DROPPED, "w"):
        pass
    freed = 0
    for p in _snapshots(path):
        freed += _size(p)
        try:
            remove_dir(p)
        except OSError:
            pass
    return freed


def discard_snapshot(snapshot: Path) -> None:
    """A snapshot that failed its check: never read again."""
    try:
        remove_dir(snapshot)
    except OSError:
        pass


def remove(path: Path) -> None:
    if _own_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def _snapshots(path: Path) -> list[Path]:
    """Every committed snapshot in the directory: a single process's, and the ranks' parts
    under torchrun (checkpoint/parts.py), their own and the ones held for a peer."""
    out = [p for _, p in list_checkpoints(path)]
    for base in (path, path / parts.HELD):
        try:
            dirs = [d for d in base.iterdir() if parts.RANK_DIR.fullmatch(d.name)]
        except OSError:
            continue
        for d in dirs:
            out += [p for _, p in list_checkpoints(d)]
    return out


def _own_dir(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.is_symlink())
