"""Verification of a mirror's checkpoints, with the verdicts of local verification.

`quick` reads the manifest (shape, signature when a key is configured, file names) and compares
the sizes it lists with the sizes the listing reports: one listing and one small read per
checkpoint. `full` also streams every file and recomputes its hash (bounded memory, every byte
downloaded once). A remote directory without manifest.json is INCOMPLETE: an upload that did not
finish.

Verdict paths are the checkpoint names (`checkpoint-<step>`); a mirror has no local path.
"""

from __future__ import annotations

from pathlib import Path

from rtrain.checkpoint import hashing
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.layout import MANIFEST
from rtrain.checkpoint.verify import Level, Status, Verdict, check_name
from rtrain.supervisor.mirror.store import CorruptRemote, Mirror, RemoteCheckpoint, checkpoints


def file_status(mirror: Mirror, name: str, member: str, entry: dict, alg: str,
                sizes: dict[str, int], level: Level) -> str:
    """"ok" or what is wrong with one listed file, as `rtrain inspect` shows it."""
    try:
        check_name(member)
    except mf.ManifestError as e:
        return f"refused: {e}"
    if member not in sizes:
        return "missing"
    if sizes[member] != entry["size"]:
        return f"size {sizes[member]}, the manifest says {entry['size']}"
    if level is Level.FULL:
        try:
            if mirror.hash_file(name, member, alg, entry["size"]) != entry["hash"]:
                return "hash mismatch"
        except CorruptRemote as e:
            return e.reason.removeprefix(f"{member}: ")
    return "ok"


def verify_remote(mirror: Mirror, rc: RemoteCheckpoint, level: Level | str = Level.QUICK,
                  key: bytes | None = None, sizes: dict[str, int] | None = None) -> Verdict:
    """Verify one remote checkpoint. `sizes` (file -> size, from `Mirror.sizes`) saves a
    listing when the caller has one. Storage errors (`MirrorError`) are raised, not verdicts:
    an unreachable mirror says nothing about its checkpoints."""
    level = Level(level)
    path = Path(rc.name)
    if not rc.committed:
        return Verdict(path, rc.step, Status.INCOMPLETE,
                       "no manifest.json (the upload did not finish)")
    try:
        m = mirror.read_manifest(rc.name)
    except CorruptRemote as e:
        return Verdict(path, rc.step, Status.CORRUPT, e.reason)
    try:
        mf.check_signature(m, key)
        alg = hashing.manifest_alg(m, key)
    except (mf.ManifestError, hashing.HashAlgError) as e:
        return Verdict(path, rc.step, Status.CORRUPT, str(e), m)
    sizes = mirror.sizes(rc.name) if sizes is None else sizes
    for member, entry in m["files"].items():
        status = file_status(mirror, rc.name, member, entry, alg, sizes, level)
        if status != "ok":
            return Verdict(path, rc.step, Status.CORRUPT, f"file {member!r}: {status}", m)
    return Verdict(path, rc.step, Status.OK, "", m)


def verify_mirror(mirror: Mirror, level: Level | str = Level.QUICK,
                  key: bytes | None = None) -> list[tuple[Verdict, int]]:
    """Every remote checkpoint, newest first, with the bytes it takes; one listing in all."""
    inventory = mirror.inventory()
    return [(verify_remote(mirror, rc, level, key, inventory[rc.name]),
             sum(inventory[rc.name].values()))
            for rc in checkpoints(inventory)]


def unlisted_files(m: dict, sizes: dict[str, int]) -> list[str]:
    """Files stored under a checkpoint that its manifest does not list."""
    return sorted(n for n in sizes if n != MANIFEST and n not in m.get("files", {}))
