"""`rtrain inspect URL` and `rtrain prune URL`: the same listings and policy for a mirror.

Only imported when the target is a URL: the mirror code and fsspec never load for a local
directory. Inspecting reads manifests and one listing (`quick`: sizes from the listing) or
streams every file through its hash (`full`); results take the shapes of local inspect
(`DirReport`, `Detail`) so the same renderers print them.
"""

from __future__ import annotations

from pathlib import Path

from rtrain.checkpoint import hashing
from rtrain.checkpoint.layout import MANIFEST, parse_step
from rtrain.checkpoint.verify import Level
from rtrain.supervisor.commands.inspecting import Detail, DirReport, Entry, FileCheck
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.mirror import verify_remote as rverify
from rtrain.supervisor.mirror.prune_remote import RemotePrune, prune_remote
from rtrain.supervisor.mirror.store import RemoteCheckpoint, open_mirror
from rtrain.supervisor.mirror.url import split_checkpoint
from rtrain.supervisor.retention.decide import RetentionPolicy


def inspect_mirror(url: str, *, verify: Level = Level.QUICK,
                   key: bytes | None = None) -> DirReport:
    """Every checkpoint at the mirror, newest first; resume would download the newest that
    verifies."""
    mirror = open_mirror(url)
    entries = [Entry(v, size) for v, size in rverify.verify_mirror(mirror, verify, key)]
    pick = next((e for e in entries if e.verdict.ok), None)
    if pick is not None:
        pick.resume = True
    return DirReport(Path(), Level(verify), entries, [], location=mirror.display)


def is_one_checkpoint(url: str) -> bool:
    return split_checkpoint(url) is not None


def inspect_mirror_one(url: str, *, verify: Level = Level.QUICK,
                       key: bytes | None = None) -> Detail:
    """One remote checkpoint file by file, from its manifest and the listing."""
    base, name = split_checkpoint(url)
    mirror = open_mirror(base)
    level = Level(verify)
    sizes = mirror.sizes(name)
    if not sizes:
        raise UsageError(f"no checkpoint at {mirror.display}/{name}")
    rc = RemoteCheckpoint(parse_step(name), name, MANIFEST in sizes)
    verdict = rverify.verify_remote(mirror, rc, level, key, sizes)
    m = verdict.manifest or {}
    files = []
    try:
        alg = hashing.manifest_alg(m, key) if m else hashing.HASH_ALG
    except hashing.HashAlgError:
        alg = None
    for member in sorted(m.get("files", {})):
        entry = m["files"][member]
        # A checkpoint that verified needs no second pass (at `full` every byte was read).
        status = ("ok" if verdict.ok else
                  "not checked (unknown hash algorithm)" if alg is None else
                  rverify.file_status(mirror, name, member, entry, alg, sizes, level))
        files.append(FileCheck(member, entry["size"], entry["hash"], status))
    files += [FileCheck(n, None, None, "not in manifest")
              for n in rverify.unlisted_files(m, sizes)]
    tensors = m.get("tensors") if isinstance(m.get("tensors"), dict) else {}
    table = {f: {t: (spec[0], spec[1]) for t, spec in tt.items()
                 if isinstance(spec, list) and len(spec) == 2}
             for f, tt in tensors.items() if isinstance(tt, dict)}
    return Detail(verdict, level, sum(sizes.values()), files, table,
                  location=f"{mirror.display}/{name}")


def prune_mirror(url: str, *, policy: RetentionPolicy, verify: Level = Level.QUICK,
                 key: bytes | None = None, dry_run: bool = False) -> RemotePrune:
    """`rtrain prune URL`: `--keep` and `--milestone-every` as locally; ranking by a metric
    (`--keep-best`) is not offered for a mirror (it would read every manifest)."""
    if split_checkpoint(url) is not None:
        raise UsageError(f"{url.rstrip('/').rpartition('/')[2]} is one checkpoint: give the "
                         "mirror URL that holds them")
    if policy.keep_best:
        raise UsageError("--keep-best is not available for a mirror: use --keep and "
                         "--milestone-every")
    mirror = open_mirror(url)
    return prune_remote(mirror, keep_remote=policy.keep or 1 << 62,
                        milestone_every=policy.milestone_every, dry_run=dry_run,
                        level=verify, key=key)


def render_mirror_prune(url: str, report: RemotePrune, *, dry_run: bool) -> str:
    from rtrain.supervisor.commands.inspect_render import human_size, table
    from rtrain.supervisor.core.untrusted_text import safe
    from rtrain.supervisor.mirror.url import redact

    verb = "would remove" if dry_run else "removed"
    rows = [[verb, r.name, why] for r, why in report.deleted]
    rows += [["would keep" if dry_run else "kept", r.name, report.why.get(r.step, "kept")]
             for r in report.kept]
    lines = [f"{safe(redact(url))}:"]
    lines += [] if report.deleted else ["nothing to remove"]
    lines += table(rows, "") if rows else []
    for v in report.failed:
        lines.append(f"{safe(v.path.name)} failed verification: {safe(v.reason)}")
    lines.append(f"{'would free' if dry_run else 'freed'} {human_size(report.bytes)}; kept "
                 f"{len(report.kept)}: {', '.join(safe(r.name) for r in report.kept) or 'none'}")
    return "\n".join(lines)

