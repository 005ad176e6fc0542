"""Which local checkpoints the uploader may send: this run's, under their own names, as they are.

A checkpoint leaves the machine only if it is a real directory (never a link: one named
`checkpoint-999999` pointing at another run's private checkpoint would copy that to the mirror
and supersede every real one), holds a manifest that parses (and is signed when a key is set),
whose step is the name's (`cp -a checkpoint-2 checkpoint-1000000` would do the same), whose run
is this run's (`checkpoint/runid.py`), and whose files are all regular files, linked nowhere, of the
sizes it lists. Their hashes are checked as each one is sent (`transfer.upload`, which also
opens every file without following a link): no byte is read twice.

`Outgoing` keeps the verdict of each name until its directory or manifest changes, so the
uploader's listing every half second reads a manifest once.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from rtrain.checkpoint import hashing, runid, safeio
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.layout import MANIFEST, list_checkpoints, parse_step
from rtrain.checkpoint.verify import check_name

NOT_COMMITTED = "no manifest.json"
"""A save that did not finish (or one in progress): no checkpoint, nothing to say."""


@dataclass(frozen=True)
class Refusal:
    step: int
    name: str
    reason: str


def check(path: Path, run: str | None, key: bytes | None) -> str | None:
    """None when the checkpoint dir `path` may be sent as run `run`'s; else why not."""
    name = path.name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return NOT_COMMITTED
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link: a link is never uploaded (the mirror gets real checkpoints)"
    if not stat.S_ISDIR(st.st_mode):
        return f"is {safeio.kind(st.st_mode)}, not a checkpoint directory"
    try:
        m = mf.load(path)
        mf.check_signature(m, key)
        hashing.manifest_alg(m, key)
    except mf.ManifestError as e:
        return NOT_COMMITTED if "no manifest.json" in str(e) else str(e)
    except hashing.HashAlgError as e:
        return str(e)
    if m["step"] != parse_step(name):
        return (f"its manifest says step {m['step']}: a copy under another name (the mirror "
                "gets each checkpoint under its own step)")
    mine = runid.of(m)
    if run is None:
        return (f"the checkpoint dir has no run identity ({runid.RUN_FILE}): nothing is "
                "uploaded until a launch settles one")
    if mine is None:
        return ("has no run identity (written outside `rtrain launch` or by an older rtrain): "
                "only this run's checkpoints are uploaded")
    if mine != run:
        return (f"belongs to another run ({runid.short(mine)}; this run is "
                f"{runid.short(run)}): only this run's checkpoints are uploaded")
    for member, entry in m["files"].items():
        why = _member(path, member, entry["size"])
        if why is not None:
            return f"file {member!r} {why}"
    return None


def _member(root: Path, member: str, size: int) -> str | None:
    try:
        check_name(member)
    except mf.ManifestError as e:
        return str(e).removeprefix(f"file name {member!r} ")
    parts = member.split("/")
    for i in range(len(parts)):
        try:
            mode = os.lstat(root.joinpath(*parts[:i + 1])).st_mode
        except FileNotFoundError:
            return "is missing"
        last = i == len(parts) - 1
        if stat.S_ISLNK(mode):
            return ("is a symbolic link: not followed" if last else
                    f"is under {'/'.join(parts[:i + 1])!r}, a symbolic link: not followed")
        if not last and not stat.S_ISDIR(mode):
            return f"is under {'/'.join(parts[:i + 1])!r}, {safeio.kind(mode)}"
        if last and not stat.S_ISREG(mode):
            return f"is {safeio.kind(mode)}, not a regular file"
    actual = os.lstat(root / member).st_size
    if actual != size:
        return f"has {actual} bytes, the manifest says {size} (truncated or rewritten)"
    return None


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when the directory or its manifest does (inode and mtime of each)."""
    try:
        d = os.lstat(path)
        if not stat.S_ISDIR(d.st_mode):
            return (d.st_ino, d.st_mtime_ns, -1, -1)
        m = os.lstat(path / MANIFEST)
        return (d.st_ino, d.st_mtime_ns, m.st_ino, m.st_mtime_ns)
    except OSError:
        return None


class Outgoing:
    """The checkpoint dir as the uploader sees it: `scan` gives the steps that may go up and
    the refusals (each said once by the caller)."""

    def __init__(self, ckpt_dir: Path, run: str | None, key: bytes | None) -> None:
        self.dir, self.run, self.key = ckpt_dir, run, key
        self._seen: dict[str, tuple[tuple | None, str | None]] = {}

    def scan(self) -> tuple[list[int], list[Refusal]]:
        ok: list[int] = []
        refused: list[Refusal] = []
        seen: dict[str, tuple[tuple | None, str | None]] = {}
        for step, path in list_checkpoints(self.dir):
            stamp = _stamp(path)
            old = self._seen.get(path.name)
            why = old[1] if old is not None and stamp is not None and old[0] == stamp \
                else check(path, self.run, self.key)
            seen[path.name] = (stamp, why)
            if why is None:
                ok.append(step)
            elif why != NOT_COMMITTED:
                refused.append(Refusal(step, path.name, why))
        self._seen = seen
        return ok, refused
