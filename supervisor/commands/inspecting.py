"""`rtrain inspect`: what is in a checkpoint directory, or in one checkpoint, read from manifests.

Torch-free and cheap: listing 100 checkpoints reads 100 manifests and stats their files
(`quick`); `full` also rehashes every byte. Rendering lives in `inspect_render`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing, safeio, safetensors_io
from rtrain.checkpoint.layout import (
    MANIFEST,
    TMP_PREFIX,
    TRASH_PREFIX,
    host_name,
    list_leftovers,
    parse_step,
)
from rtrain.checkpoint.manifest import ManifestError
from rtrain.checkpoint.verify import Level, Status, Verdict, check_member_name
from rtrain.supervisor.ckpt import foreign, hf_trainer, layouts
from rtrain.supervisor.core.errors import CheckpointError, UsageError
from rtrain.supervisor.core.untrusted_text import safe


@dataclass
class Entry:
    """One committed checkpoint as the listing shows it."""

    verdict: Verdict
    size: int
    resume: bool = False

    def meta(self, name: str, default: Any = None) -> Any:
        return _meta(self.verdict).get(name, default)


def _meta(verdict: Verdict) -> dict[str, Any]:
    # A foreign checkpoint has no manifest; what could be read of it sits in `info`.
    return verdict.manifest or verdict.info or {}


@dataclass
class Leftover:
    """A temp dir of a save (in progress or abandoned) or a trash dir of a deletion."""

    path: Path
    size: int
    kind: str  # "temp" or "trash"
    writer_alive: bool
    step: int | None = None
    host: str | None = None
    pid: int | None = None

    @property
    def remote(self) -> bool:
        """Written from another host: whether its writer lives cannot be told from here."""
        return self.host is not None and self.host != host_name()


@dataclass
class DirReport:
    ckpt_dir: Path
    level: Level
    entries: list[Entry]  # newest first
    leftovers: list[Leftover]
    location: str | None = None
    """A mirror's URL (credentials removed) when the checkpoints are not in `ckpt_dir`."""

    @property
    def where(self) -> str:
        return self.location or str(self.ckpt_dir)

    def path_of(self, e: Entry) -> str:
        """Where an entry's checkpoint is, as shown: a path, or a URL for a mirror's."""
        return f"{self.location}/{e.verdict.path.name}" if self.location else str(e.verdict.path)

    @property
    def resume(self) -> Entry | None:
        return next((e for e in self.entries if e.resume), None)

    def raise_if_failed(self) -> None:
        # A quarantined checkpoint verifies: it is set aside, not failed.
        bad = [safe(e.verdict.path.name) for e in self.entries
               if not e.verdict.ok and e.verdict.status is not Status.QUARANTINED]
        if bad:
            raise CheckpointError(f"{len(bad)} of {len(self.entries)} checkpoints failed "
                                  f"{self.level.value} verification: {', '.join(bad)}")


@dataclass
class FileCheck:
    name: str
    size: int | None  # from the manifest; None for a file the manifest does not list
    hash: str | None
    status: str  # "ok", "missing", "not in manifest", "size ...", "hash mismatch", "refused: ..."


@dataclass
class Detail:
    verdict: Verdict
    level: Level
    size: int
    files: list[FileCheck]
    # {file: {tensor: (dtype, shape)}}, or {file: "why the header could not be read"}
    tensors: dict[str, dict[str, tuple[str, list[int]]] | str] = field(default_factory=dict)
    location: str | None = None
    """A mirror's URL of the checkpoint (credentials removed), for one not on this disk."""

    @property
    def where(self) -> str:
        return self.location or str(self.verdict.path)

    def meta(self, name: str, default: Any = None) -> Any:
        return _meta(self.verdict).get(name, default)

    def raise_if_failed(self) -> None:
        if not self.verdict.ok:
            raise CheckpointError(f"{safe(self.verdict.path.name)} failed {self.level.value} "
                                  f"verification: {safe(self.verdict.describe())}")


def dir_size(path: str | os.PathLike) -> int:
    """Bytes under `path` (what deleting it frees); links count as themselves."""
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        total += dir_size(entry.path)
                    else:
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue  # removed while we looked: it no longer takes space
    except OSError:
        return total
    return total


def is_checkpoint_dir(path: Path) -> bool:
    """Whether `path` is one checkpoint (rather than a directory of them): a save of a known
    layout (accelerate's `step_80/`, DeepSpeed's `global_step80/`, DCP) is one."""
    return (path.is_file() or (path / MANIFEST).exists() or parse_step(path.name) is not None
            or path.name.startswith((TMP_PREFIX, TRASH_PREFIX))
            or foreign.layout_dir(path) is not None)


def _require_dir(path: Path) -> None:
    if not path.exists():
        raise UsageError(f"no checkpoint directory at {path}")
    if not path.is_dir():
        raise UsageError(f"{path} is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise UsageError(f"cannot read {path}: permission denied")


def inspect_dir(ckpt_dir: str | os.PathLike, *, verify: Level = Level.QUICK,
                key: bytes | None = None) -> DirReport:
    """Every committed checkpoint, newest first, and which one resume would pick at `verify`."""
    root = Path(ckpt_dir)
    _require_dir(root)
    # Every format: rtrain's, Trainer checkpoint dirs, Lightning / torch.save files.
    entries = [Entry(v, dir_size(v.path) if _real_dir(v.path) else _file_size(v.path))
               for v in foreign.verify_all(root, verify, key)]
    # Resume picks the newest checkpoint that verifies, as foreign.select_resume_any_format does.
    pick = next((e for e in entries if e.verdict.ok), None)
    if pick is not None:
        pick.resume = True
    leftovers = [
        Leftover(t.path, dir_size(t.path),
                 "trash" if t.path.name.startswith(TRASH_PREFIX) else "temp",
                 t.writer_alive(), t.step, t.host, t.pid)
        for t in list_leftovers(root)
    ]
    leftovers.sort(key=lambda lo: lo.path.name)
    return DirReport(root, Level(verify), entries, leftovers)


def _real_dir(path: Path) -> bool:
    # A link to a directory is reported, never walked: its size is the link's own.
    return path.is_dir() and not path.is_symlink()


def _file_size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _check_file(root: Path, name: str, entry: dict[str, Any], level: Level,
                alg: str = hashing.HASH_ALG) -> str:
    try:
        path = check_member_name(root, name)
        size = safeio.check_regular(path, follow_symlinks=True).st_size
    except ManifestError as e:
        return f"refused: {e}"
    except safeio.UnsafeFile as e:
        return f"refused: {e.strerror}"
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot read: {e.strerror}"
    if size != entry["size"]:
        return f"size {size}, the manifest says {entry['size']}"
    if level is Level.FULL:
        try:
            if hashing.hash_file(path, alg) != entry["hash"]:
                return "hash mismatch"
        except hashing.HashAlgError as e:
            return str(e)
        except OSError as e:
            return f"cannot read: {e.strerror}"
    return "ok"


def _files(verdict: Verdict, level: Level) -> list[FileCheck]:
    root, manifest = verdict.path, verdict.manifest or {}
    listed: dict[str, Any] = manifest.get("files", {})
    out = []
    for name in sorted(listed):
        entry = listed[name]
        # A checkpoint that verified needs no second pass; a failed one is checked file by file
        # so the listing shows which files are at fault.
        status = "ok" if verdict.ok else _check_file(root, name, entry, level,
                                                     manifest.get("hash_alg", hashing.HASH_ALG))
        out.append(FileCheck(name, entry["size"], entry["hash"], status))
    try:
        on_disk = sorted(e.name for e in os.scandir(root) if e.is_file(follow_symlinks=False)
                         ) if _real_dir(root) else []
    except OSError:
        on_disk = []
    out += [FileCheck(n, None, None, "not in manifest")
            for n in on_disk if n != MANIFEST and n not in listed]
    return out


def _tensors(verdict: Verdict, files: list[FileCheck]) -> dict[str, Any]:
    recorded = (verdict.manifest or {}).get("tensors")
    recorded = recorded if isinstance(recorded, dict) else {}
    out: dict[str, Any] = {}
    for f in files:
        if not f.name.endswith(".safetensors"):
            continue
        table = recorded.get(f.name)
        if isinstance(table, dict):
            out[f.name] = {t: (spec[0], spec[1]) for t, spec in table.items()
                           if isinstance(spec, list) and len(spec) == 2}
            continue
        if (verdict.manifest or {}).get("encryption") is not None:
            # The header is inside the encrypted file; RTRAIN_ENCRYPT_METADATA=1 left the table
            # out of the manifest on purpose.
            out[f.name] = "encrypted: names and shapes not recorded in the manifest"
            continue
        # Older or hand-made manifests lack the table: read the file's own header instead.
        try:
            path = check_member_name(verdict.path, f.name)
            header = safetensors_io.read_header(path)
        except (ManifestError, OSError, ValueError) as e:
            out[f.name] = f"header unreadable: {getattr(e, 'strerror', None) or e}"
            continue
        out[f.name] = {t: (info["dtype"], info["shape"]) for t, info in header.items()
                       if t != "__metadata__"}
    return out


def inspect_one(path: str | os.PathLike, *, verify: Level = Level.QUICK,
                key: bytes | None = None) -> Detail:
    """One checkpoint in detail: files with sizes, hashes and their state, tensors, metadata."""
    root = Path(path)
    if root.is_file():
        verdict = foreign.verify_path(root, verify, key)
        status = "ok" if verdict.ok else verdict.reason
        return Detail(verdict, Level(verify), _file_size(root),
                      [FileCheck(root.name, _file_size(root), None, status)])
    _require_dir(root)
    verdict = foreign.verify_path(root, verify, key)
    if verdict.format == foreign.Format.HF_TRAINER.value:
        return _hf_detail(verdict, Level(verify))
    layout = foreign.layout_dir(root)
    if layout is not None and verdict.format == layout.value:
        return _hf_detail(verdict, Level(verify), layouts.check(root, layout,
                                                                 full=verify is Level.FULL))
    files = _files(verdict, Level(verify))
    return Detail(verdict, Level(verify), dir_size(root), files, _tensors(verdict, files))


def _hf_detail(verdict: Verdict, level: Level,
               report: hf_trainer.Report | None = None) -> Detail:
    """A Trainer checkpoint (or another layout's save: `report`) file by file (no hashes: it
    records none), tensors from headers."""
    if report is None:
        report = hf_trainer.check(verdict.path, full=level is Level.FULL,
                                  dir_step=parse_step(verdict.path.name))
    files = [FileCheck(f.name, f.size, None, f.status) for f in report.files]
    tensors: dict[str, Any] = {}
    for f in files:
        if f.name.endswith(".safetensors") and f.status == "ok":
            try:
                header = safetensors_io.read_header(check_member_name(verdict.path, f.name))
            except (ManifestError, OSError, ValueError) as e:  # changed since it was checked
                tensors[f.name] = f"header unreadable: {getattr(e, 'strerror', None) or e}"
                continue
            tensors[f.name] = {t: (i["dtype"], i["shape"]) for t, i in header.items()
                               if t != "__metadata__"}
    return Detail(verdict, level, dir_size(verdict.path), files, tensors)
