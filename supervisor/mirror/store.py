"""A mirror of checkpoints at an fsspec URL, so a run can resume on a fresh machine.

Remote layout, the local one without temp names (docs/architecture.md, "Beyond one machine"):

    <url>/checkpoint-<step>/<every file the manifest lists>
    <url>/checkpoint-<step>/manifest.json      uploaded last: the commit marker

A remote checkpoint exists when its manifest.json does; a directory without one is an upload
that did not finish (`RemoteCheckpoint.committed` False), never downloaded. This module holds
the `Mirror`: its names, listing, manifests, delete and probe. Moving one checkpoint either way
is `transfer`'s, opening the storage `backend`'s, naming what went wrong `errors`'; callers
import the failures and `open_mirror` from here. `display` is the URL without `user:pass@` or
query: no message shows credentials.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing, layout, safeio
from rtrain.checkpoint import manifest as mf
from rtrain.supervisor.core import filemode
from rtrain.supervisor.mirror import cache as blobs
from rtrain.supervisor.mirror import transfer
from rtrain.supervisor.mirror.backend import Timeouts, open_filesystem
from rtrain.supervisor.mirror.mirror_errors import (
    CorruptLocal,
    CorruptRemote,
    MirrorError,
    OtherRun,
    Unreachable,
    storage_error,
)
from rtrain.supervisor.mirror.transfer import Transfer
from rtrain.supervisor.mirror.url import redact

__all__ = ["CorruptLocal", "CorruptRemote", "Mirror", "MirrorError", "OtherRun",
           "RemoteCheckpoint", "Timeouts", "Transfer", "Unreachable", "checkpoints", "open_mirror"]

PROBE_PREFIX = ".rtrain-probe-"


@dataclass(frozen=True)
class RemoteCheckpoint:
    step: int
    name: str
    committed: bool
    """manifest.json is present (else an upload that did not finish)."""


def open_mirror(url: str, *, file_mode: int = filemode.DEFAULT_FILE_MODE,
                timeouts: Timeouts | None = None) -> Mirror:
    """The mirror at `url`: `s3://bucket/prefix`, `gs://...`, `file:///path`, or a plain path
    (a shared filesystem). Nothing is contacted yet (`Mirror.probe` does). `timeouts` bound
    each remote call (default: `backend.Timeouts()`, the settings' defaults)."""
    fs, root, local = open_filesystem(url, timeouts)
    return Mirror(url, fs, root, local=local, file_mode=file_mode)


def checkpoints(inventory: dict[str, dict[str, int]]) -> list[RemoteCheckpoint]:
    """The checkpoints of a `Mirror.inventory()`, newest first."""
    out = [RemoteCheckpoint(layout.parse_step(n), n, layout.MANIFEST in files)
           for n, files in inventory.items()]
    return sorted(out, key=lambda r: r.step, reverse=True)


class Mirror:
    """Checkpoints under one URL. Every failure of the storage is a `MirrorError`."""

    def __init__(self, url: str, fs: Any, root: str, *, local: bool,
                 file_mode: int = filemode.DEFAULT_FILE_MODE) -> None:
        self.url = url
        self.display = redact(url)
        self.fs = fs
        self.root = root
        self.local = local  # a filesystem path: fsync what is written, as for a local commit
        # A directory mirror gets the run's modes (private unless file_mode shares it); an
        # object store keeps its bucket's policy and ACLs (s3fs writes objects private).
        self.file_mode = file_mode

    def __repr__(self) -> str:
        return f"Mirror({self.display!r})"

    def path(self, name: str, member: str | None = None) -> str:
        """Where checkpoint `name` (or one of its files) is, in the backend's terms."""
        return f"{self.root}/{name}" if member is None else f"{self.root}/{name}/{member}"

    def error(self, what: str, exc: BaseException) -> MirrorError:
        """A storage error as the one line a user reads (`Unreachable` when nobody answered)."""
        return storage_error(self.display, what, exc, local=self.local)

    def step_of(self, name: str) -> int:
        """The step of checkpoint `name`; a name that is not `checkpoint-<step>` is refused."""
        step = layout.parse_step(name)
        if step is None:
            raise MirrorError(f"{name!r} is not a checkpoint name (checkpoint-<step>)")
        return step

    def remove(self, path: str, what: str, *, recursive: bool = False) -> None:
        """Delete `path` (gone already is fine); `what` names the step in the error."""
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self.error(what, e) from None

    # -- listing and reading --------------------------------------------------------------

    def _listing(self, path: str) -> dict[str, int]:
        """`relative path -> size` of every object under `path`; nothing there is empty."""
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self.error("cannot list", e) from None
        prefix = path.rstrip("/") + "/"
        return {p[len(prefix):]: int(info.get("size") or 0) for p, info in found.items()
                if p.startswith(prefix) and info.get("type", "file") != "directory"}

    def inventory(self) -> dict[str, dict[str, int]]:
        """`checkpoint name -> {file: size}` of every checkpoint directory, from one recursive
        listing (on S3, one request per 1000 objects). Other names under the prefix are not
        checkpoints and are left out."""
        out: dict[str, dict[str, int]] = {}
        for rel, size in self._listing(self.root).items():
            top, _, member = rel.partition("/")
            if member and layout.parse_step(top) is not None:
                out.setdefault(top, {})[member] = size
        return out

    def list(self) -> list[RemoteCheckpoint]:
        """Every remote checkpoint directory, newest first: committed ones and unfinished
        uploads."""
        return checkpoints(self.inventory())

    def sizes(self, name: str) -> dict[str, int]:
        """`file -> size` of what is stored under checkpoint `name` (manifest.json included)."""
        self.step_of(name)
        return self._listing(self.path(name))

    def read_manifest_bytes(self, name: str) -> bytes:
        """The raw manifest.json of `name`, at most `manifest.MAX_BYTES`."""
        self.step_of(name)
        path = self.path(name, layout.MANIFEST)
        try:
            with self._open_read(path, mf.MAX_BYTES + 1) as f:
                raw = f.read(mf.MAX_BYTES + 1)
        except FileNotFoundError:
            raise CorruptRemote(name, "no manifest.json (the upload did not finish)") from None
        except safeio.UnsafeFile as e:
            raise CorruptRemote(name, f"manifest.json {e.strerror}") from None
        except Exception as e:
            raise self.error(f"cannot read {name}/manifest.json", e) from None
        if len(raw) > mf.MAX_BYTES:
            raise CorruptRemote(name, f"manifest.json is larger than {mf.MAX_BYTES >> 20} MiB: "
                                "not an rtrain manifest")
        return raw

    def read_manifest(self, name: str) -> dict:
        """The parsed and shape-checked manifest of `name` (`CorruptRemote` with the reason)."""
        return self.parse_manifest(name, self.read_manifest_bytes(name))

    def parse_manifest(self, name: str, raw: bytes) -> dict:
        """`raw` parsed and checked against `name`'s step (`CorruptRemote` with the reason)."""
        try:
            m = mf.parse(raw)
        except mf.ManifestError as e:
            raise CorruptRemote(name, str(e)) from None
        if m["step"] != self.step_of(name):
            raise CorruptRemote(name, f"manifest says step {m['step']} but the directory is "
                                f"{name}")
        return m

    def hash_file(self, name: str, member: str, alg: str, size: int) -> str:
        """Stream one remote file through `alg` (bounded memory); `CorruptRemote` when its size
        is not `size`."""
        h = hashing.new_hasher(alg)
        n = self._stream(name, member, size, h.update)
        if n != size:
            raise CorruptRemote(name, f"{member}: has {n} bytes, the manifest says {size} "
                                "(truncated or rewritten)")
        return h.hexdigest()

    def _open_read(self, path: str, block: int):
        if self.local:
            # Anyone who can write a shared directory can put a FIFO or a device under a listed
            # name: opening it would hang or misbehave. Only regular files are read.
            return safeio.open_regular(path, follow_symlinks=True)
        # Unbuffered ranged reads of `block` bytes: what is read is what was asked for.
        return self.fs.open(path, "rb", block_size=block, cache_type="none")

    def _stream(self, name: str, member: str, size: int, sink) -> int:
        """Feed the remote file to `sink` chunk by chunk; reads at most `size + 1` bytes (one
        more tells a longer file). Returns the bytes read."""
        n = 0
        try:
            with self._open_read(self.path(name, member), transfer.CHUNK) as f:
                while n <= size:
                    chunk = f.read(min(transfer.CHUNK, size + 1 - n))
                    if not chunk:
                        break
                    sink(chunk)
                    n += len(chunk)
        except FileNotFoundError:
            raise CorruptRemote(name, f"{member}: missing") from None
        except safeio.UnsafeFile as e:
            raise CorruptRemote(name, f"{member} {e.strerror}") from None
        except MirrorError:
            raise
        except Exception as e:
            raise self.error(f"cannot read {name}/{member}", e) from None
        return n

    # -- moving one checkpoint (transfer) -------------------------------------------------

    def upload(self, local: Path, *, parallel: int = 4, resend: bool = False) -> Transfer:
        """Upload the committed checkpoint dir `local`: every file its manifest lists, hashed
        just before it is sent, `parallel` at a time; then manifest.json. An unfinished remote
        copy is overwritten; an identical committed one is left as it is (0 bytes sent); a
        different committed one (the run rolled back and saved that step again) is decommitted
        first, so no reader ever sees its manifest beside the new files; one of another run is
        never replaced (`OtherRun`). `resend`: send the files even when the remote manifest is
        the same (its files failed verification)."""
        return transfer.upload(self, local, parallel=parallel, resend=resend)

    def download(self, name: str, ckpt_dir: Path, *, key: bytes | None = None,
                 cache: blobs.BlobCache | None = None, file_mode: int = 0o600,
                 parallel: int = 4) -> Transfer:
        """Download `name` into `ckpt_dir/name` by the local commit protocol. Files whose
        content is already here (a local checkpoint or `cache`) are linked or copied instead;
        every file is hashed either way. A `checkpoint-<step>` already in `ckpt_dir` that
        verifies is kept (nothing replaced)."""
        return transfer.download(self, name, ckpt_dir, key=key, cache=cache,
                                 file_mode=file_mode, parallel=parallel)

    # -- delete and probe -----------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove checkpoint `name`: manifest.json first (from then on it is no checkpoint
        anyone resumes from), then the rest."""
        self.step_of(name)
        self.remove(self.path(name, layout.MANIFEST), f"cannot delete {name}/manifest.json")
        self.remove(self.path(name), f"cannot delete {name}", recursive=True)

    def probe(self) -> None:
        """Write, read back and delete a small object under the prefix; a `MirrorError` names
        the step that failed and what to check."""
        path = f"{self.root}/{PROBE_PREFIX}{layout.host_name()}-{os.getpid()}-" \
               f"{os.urandom(4).hex()}"
        data = b"rtrain mirror probe\n"
        for what, op in (("cannot write", lambda: self.fs.pipe_file(path, data)),
                         ("cannot read back", lambda: self.fs.cat_file(path)),
                         ("cannot delete", lambda: self.fs.rm(path))):
            try:
                result = op()
            except Exception as e:
                raise self.error(what, e) from None
            if what == "cannot read back" and result != data:
                raise MirrorError(f"mirror {self.display}: read back other bytes than were "
                                  "written: check the endpoint (AWS_ENDPOINT_URL)")

