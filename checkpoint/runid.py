"""Which run a checkpoint belongs to: the run identity.

`<ckpt_dir>/.rtrain-run` holds the identity of the run that writes the directory: 32 hex
digits. Each commit copies it into its manifest (`run`, covered by the signature), so a
checkpoint says which run wrote it wherever it is copied: the mirror's uploader sends only this
run's checkpoints and counts only this run's on the mirror as newer, and a resume from the
mirror downloads only this run's.

The launch settles the identity at its first pick (`settle`, pure):

- a new run that starts over (`--resume never`) gets a new one: its checkpoints and those of
  the run that used the directory before are kept apart;
- otherwise the directory's identity stays;
- a directory without one takes that of the checkpoint it resumes from (a fresh machine
  continuing a run from the mirror, `--resume PATH`), else a new one.

Checkpoints without `run` (an older rtrain, a script outside `rtrain launch`) belong to no run:
kept and resumed from as before, never uploaded, never counted as a run's on the mirror.

A teammate who can write the checkpoint directory can rewrite the file as they can rewrite any
checkpoint: the identity keeps runs apart by accident (a copy, a link, an earlier run under the
same URL), not against a writer of the directory.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rtrain.checkpoint import safeio
from rtrain.supervisor.core import atomic_write, filemode

RUN_FILE = ".rtrain-run"
_RUN_RE = re.compile(r"[0-9a-f]{32}")


def new() -> str:
    return uuid.uuid4().hex


def valid(run: Any) -> bool:
    return isinstance(run, str) and _RUN_RE.fullmatch(run) is not None


def of(manifest: dict[str, Any] | None) -> str | None:
    """The run a manifest names (`manifest.parse` checked its shape); None: none."""
    run = (manifest or {}).get("run")
    return run if valid(run) else None


def short(run: str | None) -> str:
    """How messages name a run: its first 8 digits."""
    return run[:8] if run else "none"


def whose(run: str | None) -> str:
    """How messages name the run a checkpoint belongs to."""
    return f"run {run[:8]}" if run else "no run identity: an older rtrain's"


def read(ckpt_dir: str | os.PathLike) -> str | None:
    """The directory's identity; None when it has none (or the file holds something else)."""
    try:
        raw = safeio.read_limited(Path(ckpt_dir) / RUN_FILE, 256)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return None  # a link or a FIFO under the name: no identity, never followed
    text = raw.decode("ascii", errors="replace").strip()
    return text if valid(text) else None


def write(ckpt_dir: str | os.PathLike, run: str, mode: int = filemode.DEFAULT_FILE_MODE, *,
          replace: bool = True) -> str:
    """Make `run` the directory's identity: a temp file renamed over the old one, so a reader
    sees the old identity or the new one, never half of either. `replace=False` claims it
    only where the directory has none (nodes of one run settling at once all end up with the
    first one's). Returns the identity the directory has now."""
    if not valid(run):
        raise ValueError(f"not a run identity: {run!r}")
    ckpt_dir = Path(ckpt_dir)
    atomic_write.write_atomic(ckpt_dir / RUN_FILE, run + "\n", mode=mode, replace=replace)
    return run if replace else read(ckpt_dir) or run


def settle(current: str | None, resumed_run: str | None, *, start_over: bool) -> str | None:
    """The identity the launch goes on with; None: draw a new one (`new`). `current`: the
    directory's; `resumed_run`: that of the checkpoint the first attempt resumes from;
    `start_over`: a new run that resumes from nothing by request (`--resume never`)."""
    if start_over:
        return None
    return current or resumed_run


def continued_run(candidates: Iterable[tuple[str | None, float]]) -> str | None:
    """On a machine with no identity yet, the run a resume from the mirror continues: the one
    whose checkpoint was committed last (`created`), of `(run, created)` of the mirror's
    verified checkpoints. An earlier run under the same URL committed before it; a run that
    went on elsewhere since committed after. None: none of them has an identity (an older
    rtrain's), or there are none."""
    newest = max(candidates, key=lambda rc: rc[1], default=None)
    return None if newest is None else newest[0]
