"""Quarantined checkpoints: they verify, but attempts resumed from them kept failing.

The supervisor decides a quarantine (`policy.quarantine_streak`) and keeps the list in
state.json; it also publishes it into the checkpoint directory as `quarantine.json`, so that
everything reading that directory sees it: resume selection (the supervisor's and the worker's
own), retention (`rtrain prune`, the Checkpointer's `keep`), which then treat the checkpoint as
not good, so the one before it stays the newest good one and is never deleted for it, and
`rtrain inspect`, which shows `quarantined: <reason>`. An explicit `--resume PATH` still loads it.

Schema v1: {"v": 1, "checkpoints": {"<name>": {"id": "<inode>-<mtime_ns>", "step": n,
"reason": "..."}}}. The id ties an entry to one checkpoint: a step saved again (a replay after
the fallback) is a new directory with a new id and is not quarantined.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rtrain.checkpoint import safeio
from rtrain.supervisor.core.atomic_write import write_json_atomic
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE

log = logging.getLogger(__name__)

QUARANTINE_FILE = "quarantine.json"
VERSION = 1
MAX_BYTES = 1 << 20


def checkpoint_id(path: str | os.PathLike) -> str:
    """Identity of the checkpoint now at `path` ("" when it is gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_ino}-{st.st_mtime_ns}"


def load(ckpt_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Checkpoint name -> entry; {} when nothing is quarantined."""
    path = Path(ckpt_dir) / QUARANTINE_FILE
    try:
        # Anyone who can write the dir can put a FIFO or a bomb here: read it as a manifest.
        raw = safeio.parse_json(safeio.read_limited(path, MAX_BYTES))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        log.warning("%s is unreadable (%s): no checkpoint counts as quarantined", path, err)
        return {}
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        log.warning("%s: version %r is not %d: ignored", path,
                    raw.get("v") if isinstance(raw, dict) else None, VERSION)
        return {}
    table = raw.get("checkpoints")
    return table if isinstance(table, dict) else {}


def reason_for(path: str | os.PathLike, table: dict[str, dict[str, Any]]) -> str | None:
    """Why the checkpoint at `path` is quarantined, or None."""
    entry = table.get(Path(path).name)
    if not isinstance(entry, dict) or entry.get("id") != checkpoint_id(path):
        return None
    return str(entry.get("reason") or "quarantined")


def publish(ckpt_dir: str | os.PathLike, entries: Iterable[dict[str, Any]], *,
            mode: int = DEFAULT_FILE_MODE) -> None:
    """Write `quarantine.json` for `entries` (History.quarantined), atomically; none: remove."""
    root = Path(ckpt_dir)
    table = {Path(e["path"]).name: {"id": e["id"], "step": e.get("step"), "reason": e["reason"]}
             for e in entries}
    target = root / QUARANTINE_FILE
    if not table:
        if os.path.lexists(target):  # nothing to write: a read-only dir must not fail here
            target.unlink()
        return
    write_json_atomic(target, {"v": VERSION, "checkpoints": table}, mode=mode)
