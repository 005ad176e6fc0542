"""Writing rtrain's small files safely, torch-free, used by both halves.

`write_atomic` replaces a file so that a reader sees the old content or the new, never half of
one: a temp file in the same directory (same filesystem, so the rename is atomic), written with
the file's mode, renamed over the target. With `durable=True` the data is fsynced before the
rename and the directory after it, so the new file also survives a power cut (state.json, the
quarantine table); files rewritten every few seconds (metrics, the process record) skip that.

`STORAGE_ERRNOS` names the errors of the storage rather than of the program: a full disk or
quota, a failing or read-only one. Callers wait them out or skip a write; they never end a run.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE, set_mode

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})


def write_atomic(path: Path, data: str | bytes, *, mode: int = DEFAULT_FILE_MODE,
                 durable: bool = True, replace: bool = True) -> None:
    """Replace `path` with `data`; on any error the target is untouched and no temp file is
    left. Missing parent directories are created. `replace=False`: only where there is no
    `path` yet (linked into place, never over one: of several writers at once the first
    wins, and every one then reads the same content)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        set_mode(fd, mode)  # mkstemp makes 0600 whatever the policy says
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
            os.unlink(tmp)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:  # the rename itself must reach the disk
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_json_atomic(path: Path, obj: Any, *, mode: int = DEFAULT_FILE_MODE) -> None:
    """`obj` as indented JSON, durably (`write_atomic`)."""
    write_atomic(path, json.dumps(obj, indent=1) + "\n", mode=mode)
