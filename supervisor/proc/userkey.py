"""A secret of this user, kept outside every run dir: it signs what rtrain leaves in a run dir
for its own later use, so that someone else who may write the run dir cannot forge it.

`procs.json` (leftovers.py) names processes the next launch SIGKILLs. A run dir shared with a
group is writable by the group, and the pids and start times it would name are public in
/proc: unsigned, the file would let a teammate have rtrain kill any process of the user. So
`procs.json` carries an HMAC under this key, and the next launch ends only what it names when
the HMAC verifies (or what carries the run's mark in its own environment).

The key is 32 random bytes in `$XDG_STATE_HOME/rtrain/leftovers.key`
(`~/.local/state/rtrain/leftovers.key` without it), made on first use: the directory 0700, the
file 0600. It is read only when it is a regular file owned by this user that no one else may
read or write; otherwise, or where it cannot be made (no home, a read-only one), there is no
key: procs.json is written unsigned and a later launch ends only the processes whose
environment carries the run's mark, saying which it left alone and why.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from rtrain.supervisor.core.atomic_write import write_atomic

KEY_NAME = "leftovers.key"
KEY_BYTES = 32


def key_path() -> Path | None:
    """Where this user's key lives; None where no home is known."""
    base = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(base):
        return Path(base) / "rtrain" / KEY_NAME
    try:
        return Path.home() / ".local" / "state" / "rtrain" / KEY_NAME
    except (RuntimeError, KeyError):  # no HOME and no passwd entry (an arbitrary container uid)
        return None


def load(*, create: bool) -> tuple[bytes | None, str]:
    """(this user's key, "") or (None, why there is none). `create`: make it when missing."""
    path = key_path()
    if path is None:
        return None, "no home directory to keep rtrain's key in"
    try:
        return _read(path), ""
    except FileNotFoundError:
        if not create:
            return None, f"no key at {path}"
    except (OSError, ValueError) as e:
        return None, f"cannot use the key at {path}: {_why(e)}"
    try:
        _make(path)
        return _read(path), ""
    except (OSError, ValueError) as e:
        return None, f"cannot make the key at {path}: {_why(e)}"


def sign(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def verify(key: bytes, message: bytes, mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(key, message), mac)


def _why(e: Exception) -> str:
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ValueError("not a regular file of this user")
        if st.st_mode & 0o077:
            raise ValueError(f"mode {stat.S_IMODE(st.st_mode):04o} lets others read or write "
                             "it (chmod 600 it, or remove it to have a new one made)")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ValueError(f"it holds {len(data)} bytes, not {KEY_BYTES}")
    return data


def _make(path: Path) -> None:
    """Write a new key under a temporary name and link it into place: two launches making it
    at once end up with the same key (the second link fails, both read the first's)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, secrets.token_bytes(KEY_BYTES), mode=0o600, replace=False)
