"""Verification of committed checkpoints and resume selection, from manifests alone.

`quick` checks the manifest, the signature (when a key is configured), file names and sizes;
`full` also recomputes every content hash. A checkpoint that fails is reported with the reason a
person reads and skipped, never deleted here.
"""

from __future__ import annotations

import enum
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing, manifest, quarantine, safeio, state_schema
from rtrain.checkpoint.layout import MANIFEST, list_checkpoints, parse_step


class Level(str, enum.Enum):
    QUICK = "quick"
    FULL = "full"


class Status(str, enum.Enum):
    OK = "ok"
    CORRUPT = "corrupt"
    INCOMPLETE = "incomplete"  # no manifest: a save that did not finish
    QUARANTINED = "quarantined"  # verifies, but resuming from it kept failing (quarantine.py)
    WRONG_KEY = "wrong_key"  # verifies, but is encrypted under a key this run does not hold


@dataclass
class Verdict:
    path: Path
    step: int
    status: Status
    reason: str = ""
    manifest: dict[str, Any] | None = field(default=None, repr=False)
    format: str = "rtrain"
    """"rtrain", or a foreign format (`ckpt.foreign.Format`): "hf-trainer", "lightning", "torch"."""
    info: dict[str, Any] | None = field(default=None, repr=False)
    """For a foreign checkpoint: what could be read without unpickling (step, epoch, metrics,
    created, note), shaped like the manifest's fields of the same names."""

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def describe(self) -> str:
        return self.status.value if self.ok else f"{self.status.value}: {self.reason}"


def check_name(name: str) -> None:
    """The part of `check_member_name` that needs no filesystem: for names that will become
    paths elsewhere (a mirror's object keys, a download's temp dir)."""
    if not name or name.startswith(("/", "\\")) or os.path.isabs(name):
        raise manifest.ManifestError(f"file name {name!r} is an absolute path")
    parts = name.replace("\\", "/").split("/")
    if any(p in ("..", "") for p in parts) or "\x00" in name:
        raise manifest.ManifestError(f"file name {name!r} leaves the checkpoint directory")
    if name == MANIFEST:
        raise manifest.ManifestError("the manifest lists itself")


def check_member_name(root: Path, name: str) -> Path:
    """File names in a manifest are data: refuse anything that could leave the checkpoint."""
    check_name(name)
    path = root / name
    if "/" not in name:
        # With absolute names and '..' refused, only a link can lead outside; for a plain file
        # directly in the checkpoint (the usual case) one lstat settles it, no realpath needed.
        try:
            if not stat.S_ISLNK(os.lstat(path).st_mode):
                return path
        except FileNotFoundError:
            return path  # the caller reports it missing
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise manifest.ManifestError(f"file {name!r} is a link leading outside the checkpoint")
    return path


def verify(
    path: str | os.PathLike, level: Level | str = Level.FULL, key: bytes | None = None
) -> Verdict:
    """Verify one committed checkpoint directory."""
    path = Path(path)
    level = Level(level)
    step = parse_step(path.name)
    step = -1 if step is None else step
    try:
        m = manifest.load(path)
    except manifest.ManifestError as e:
        status = Status.INCOMPLETE if "no manifest.json" in str(e) else Status.CORRUPT
        return Verdict(path, step, status, str(e))
    try:
        manifest.check_signature(m, key)
        alg = hashing.manifest_alg(m, key)
        if step >= 0 and m["step"] != step:
            raise manifest.ManifestError(
                f"manifest says step {m['step']} but the directory is {path.name}"
            )
        for name, entry in m["files"].items():
            member = check_member_name(path, name)
            try:
                # A FIFO or device listed here would hang or misbehave when hashed or loaded.
                st = safeio.check_regular(member, follow_symlinks=True)
            except FileNotFoundError:
                raise manifest.ManifestError(f"file {name!r} is missing") from None
            except safeio.UnsafeFile as e:
                raise manifest.ManifestError(f"file {name!r} {e.strerror}") from None
            if st.st_size != entry["size"]:
                raise manifest.ManifestError(
                    f"file {name!r} has {st.st_size} bytes, the manifest says {entry['size']} "
                    "(truncated or rewritten)"
                )
        if level is Level.FULL:
            for name, entry in m["files"].items():
                if hashing.hash_file(path / name, alg) != entry["hash"]:
                    raise manifest.ManifestError(
                        f"file {name!r} content hash does not match the manifest "
                        "(bytes changed on disk)"
                    )
            check_state_file(path, m)
    except (manifest.ManifestError, hashing.HashAlgError) as e:
        return Verdict(path, step, Status.CORRUPT, str(e), m)
    except OSError as e:
        return Verdict(path, step, Status.CORRUPT, f"cannot read: {e.strerror or e}", m)
    return Verdict(path, m["step"], Status.OK, "", m)


STATE_FILE = "state.json"
STATE_LIMIT = 1 << 30  # state.json: JSON of the non-tensor state, never near this
_STATE_DEPTH = 256  # the user's extras nest; a loader's JSON parser stops near 1000


def check_state_file(path: Path, m: dict[str, Any]) -> None:
    """state.json against its schema (`checkpoint/state_schema.py`), at `full` only (it reads the
    file): a field missing or of the wrong type, with a hash recomputed to match, verifies as
    corrupt here, as it fails the worker's load. An encrypted checkpoint's state.json needs the
    key, which verification never has: the worker checks it when it loads."""
    if STATE_FILE not in m["files"] or m.get("encryption") is not None:
        return
    try:
        raw = safeio.read_limited(check_member_name(path, STATE_FILE), STATE_LIMIT,
                                  follow_symlinks=True)
        st = safeio.parse_json(raw, max_depth=_STATE_DEPTH)
    except ValueError as e:
        raise manifest.ManifestError(f"{STATE_FILE} {e}") from None
    table = m.get("tensors")

    def names(stem: str) -> set[str] | None:
        if not isinstance(table, dict):
            return None  # an older manifest without the tensor table: references unchecked
        listed = table.get(f"{stem}.safetensors", {})
        return set(listed) if isinstance(listed, dict) else None

    try:
        state_schema.check(st, step=m["step"], extra_tensors=names("extra"),
                           optimizer_tensors=names("optimizer"))
    except state_schema.StateSchemaError as e:
        raise manifest.ManifestError(str(e)) from None


def verify_all(
    ckpt_dir: str | os.PathLike, level: Level | str = Level.QUICK, key: bytes | None = None
) -> list[Verdict]:
    """Every committed checkpoint, newest first."""
    return list(mark_quarantined(ckpt_dir, (verify(p, level, key)
                                            for _, p in list_checkpoints(ckpt_dir))))


def mark_quarantined(ckpt_dir: str | os.PathLike,
                     verdicts: Iterable[Verdict]) -> Iterable[Verdict]:
    """`verdicts`, with each good one listed in the dir's quarantine.json turned QUARANTINED."""
    table = quarantine.load(ckpt_dir)
    for v in verdicts:
        why = quarantine.reason_for(v.path, table) if v.ok and table else None
        yield replace(v, status=Status.QUARANTINED, reason=why) if why else v


@dataclass
class Selection:
    chosen: Verdict | None
    skipped: list[Verdict]  # newer checkpoints that failed, with their reasons


def select_rtrain_resume(
    ckpt_dir: str | os.PathLike,
    level: Level | str = Level.FULL,
    key: bytes | None = None,
    skip_newest: int = 0,
    on_skip: Callable[[Verdict], None] | None = None,
) -> Selection:
    """The newest of rtrain's own checkpoints that verifies; each newer one that fails is
    reported. The worker resumes through this (it loads only its own format); a launch picks
    over every format with `foreign.select_resume_any_format`.

    `skip_newest` passes over that many verified checkpoints (a rollback after a non-finite
    loss resumes from the one before the newest).
    """
    return first_good(mark_quarantined(ckpt_dir, (verify(p, level, key)
                                                  for _, p in list_checkpoints(ckpt_dir))),
                      skip_newest, on_skip)


def first_good(verdicts: Iterable[Verdict], skip_newest: int = 0,
               on_skip: Callable[[Verdict], None] | None = None) -> Selection:
    """The first verdict that is ok after passing over `skip_newest` good ones; verdicts are
    computed lazily, so nothing older than the pick is verified."""
    skipped = []
    for v in verdicts:
        if v.ok and skip_newest > 0:
            skip_newest -= 1
            continue
        if v.ok:
            return Selection(v, skipped)
        skipped.append(v)
        if on_skip:
            on_skip(v)
    return Selection(None, skipped)


class VerifiedCache:
    """Checkpoints known to pass full verification, so that a process pruning after every save
    re-hashes only what changed.

    An entry holds the identity of the manifest and of every file it lists (device, inode, size,
    mtime, ctime): rewriting a byte changes the ctime, which no user can set back, so `holds` is
    false again and the checkpoint is hashed anew.
    """

    def __init__(self) -> None:
        self._ids: dict[Path, tuple] = {}

    def add(self, v: Verdict) -> None:
        """Record `v`, which passed full verification (or was hashed as it was written)."""
        if not v.ok:
            return
        ident = _identity(v)
        if ident is not None:
            self._ids[v.path] = ident

    def holds(self, v: Verdict) -> bool:
        ident = self._ids.get(v.path)
        return ident is not None and ident == _identity(v)

    def forget(self, path: Path) -> None:
        self._ids.pop(path, None)


def _identity(v: Verdict) -> tuple | None:
    if v.manifest is None:
        return None
    out = []
    try:
        for name in (MANIFEST, *sorted(v.manifest["files"])):
            st = os.stat(v.path / name)
            out.append((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    except OSError:
        return None
    return tuple(out)
