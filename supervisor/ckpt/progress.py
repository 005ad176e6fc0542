"""Progress from content, not names: did an attempt leave a new verified foreign checkpoint?

rtrain's own checkpoints and step-named foreign ones show progress by their step. A script that
rewrites one `ckpt.pt` (or `last.ckpt`) in place shows it only by the file's content changing.
So, for foreign checkpoints, the loop takes a `snapshot` of every candidate's content
`fingerprint` when an attempt starts; when it ends, `advanced` says whether one of them (any
name) now has content that was not there at the start and verifies, with a
step that is unknown or above the step that path had at the start (a script that re-saves the
checkpoint it just loaded, before training, has made no progress).

A fingerprint is the size and an xxh3 of the first and last 64 KiB. For a torch.save file the
last bytes are the zip's central directory, which holds every member's CRC-32: a change of any
tensor changes it, and a rewrite with the same bytes (or a `touch`) does not. Directories are
candidates only by a step in their name (`checkpoint-400/`, `step_400/`, `global_step400/`), so
their progress is by step; a fingerprint is a file's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

from rtrain.supervisor.core import ownfiles

_END = 64 << 10


@dataclass(frozen=True)
class Mark:
    """One foreign candidate as seen at a moment: its content, and what verification said."""

    path: str
    fingerprint: str | None  # None: unreadable (gone, a FIFO, no permission)
    step: int | None = None
    ok: bool = False


def fingerprint(path: str | os.PathLike) -> str | None:
    """The content's identity (see the module docstring); None when it cannot be read."""
    try:
        return _file_fingerprint(Path(path))
    except OSError:  # gone, a link (O_NOFOLLOW), no permission
        return None


def _file_fingerprint(path: Path) -> str | None:
    h = xxhash.xxh3_64()
    opened = ownfiles.open_own(path)  # a link, a FIFO: refused (an OSError), never waited on
    fd, st = opened.fd, opened.st
    try:
        h.update(os.pread(fd, _END, 0))
        if st.st_size > _END:
            h.update(os.pread(fd, _END, max(st.st_size - _END, _END)))
    finally:
        os.close(fd)
    return f"{st.st_size}:{h.hexdigest()}"


def advanced(before: Mapping[str, Mark], after: Iterable[Mark]) -> Mark | None:
    """The first (newest-first) verified candidate whose content is new since `before` and
    whose step, if known, is above the step its path had then; None when there is none. Pure."""
    for m in after:
        if not m.ok or m.fingerprint is None:
            continue
        old = before.get(m.path)
        if old is not None and old.fingerprint == m.fingerprint:
            continue
        if old is not None and m.step is not None and old.step is not None and (
                m.step <= old.step):
            continue
        return m
    return None
