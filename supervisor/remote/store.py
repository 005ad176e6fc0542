"""A mirror of checkpoints at an fsspec URL, so a run can resume on a fresh machine.

Remote layout, the local one without temp names (docs/design.md, "Mirror"):

    <url>/checkpoint-<step>/<every file the manifest lists>
    <url>/checkpoint-<step>/manifest.json      uploaded last: the commit marker

A remote checkpoint exists when its manifest.json does; a directory without one is an upload
that did not finish (`RemoteCheckpoint.committed` False), never downloaded. Uploads hash every
local file while sending it and refuse a file that differs from the local manifest
(`CorruptLocal`); downloads hash while receiving, into a temp dir renamed into place only when
every file matches (`CorruptRemote` otherwise), exactly like a local commit.

This module is the public face (`open_mirror`, `Mirror`, the results and errors); moving bytes
lives in transfer.py, opening the filesystem (fsspec, S3 timeouts) in backend.py, the error
wording in errors.py. Credentials and endpoint come only from the backend's own chain; no
message shows them, and `display` is the URL without `user:pass@` or query.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.ckpt import hashing, layout, safeio
from supervisor.ckpt import manifest as mf
from supervisor.remote import transfer
from supervisor.remote.backend import open_fs
from supervisor.remote.cache import BlobCache
from supervisor.remote.errors import CorruptLocal, CorruptRemote, MirrorError, explain
from supervisor.remote.transfer import CHUNK, Transfer
from supervisor.remote.url import redact

__all__ = ["CorruptLocal", "CorruptRemote", "Mirror", "MirrorError", "RemoteCheckpoint",
           "Transfer", "checkpoints", "open_mirror"]

PROBE_PREFIX = ".rtrain-probe-"


@dataclass(frozen=True)
class RemoteCheckpoint:
    step: int
    name: str
    committed: bool
    """manifest.json is present (else an upload that did not finish)."""


def open_mirror(url: str) -> Mirror:
    """The mirror at `url`: `s3://bucket/prefix`, `gs://...`, `file:///path`, or a plain path
    (a shared filesystem). Nothing is contacted yet (`Mirror.probe` does)."""
    fs, root, local = open_fs(url)
    return Mirror(url, fs, root, local=local)


def checkpoints(inventory: dict[str, dict[str, int]]) -> list[RemoteCheckpoint]:
    """The checkpoints of a `Mirror.inventory()`, newest first."""
    out = [RemoteCheckpoint(layout.parse_step(n), n, layout.MANIFEST in files)
           for n, files in inventory.items()]
    return sorted(out, key=lambda r: r.step, reverse=True)


class Mirror:
    """Checkpoints under one URL. Every failure of the storage is a `MirrorError`."""

    def __init__(self, url: str, fs: Any, root: str, *, local: bool) -> None:
        self.url = url
        self.display = redact(url)
        self.fs = fs
        self.root = root
        self.local = local  # a filesystem path: fsync what is written, as for a local commit

    def __repr__(self) -> str:
        return f"Mirror({self.display!r})"

    def _path(self, name: str, member: str | None = None) -> str:
        return f"{self.root}/{name}" if member is None else f"{self.root}/{name}/{member}"

    def _error(self, what: str, exc: BaseException) -> MirrorError:
        return MirrorError(f"mirror {self.display}: {what} {explain(exc, local=self.local)}")

    def _step(self, name: str) -> int:
        step = layout.parse_step(name)
        if step is None:
            raise MirrorError(f"{name!r} is not a checkpoint name (checkpoint-<step>)")
        return step

    # -- listing and reading --------------------------------------------------------------

    def _listing(self, path: str) -> dict[str, int]:
        """`relative path -> size` of every object under `path`; nothing there is empty."""
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self._error("cannot list", e) from None
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
        self._step(name)
        return self._listing(self._path(name))

    def read_manifest_bytes(self, name: str) -> bytes:
        """The raw manifest.json of `name`, at most `manifest.MAX_BYTES`."""
        self._step(name)
        path = self._path(name, layout.MANIFEST)
        try:
            with self._open_read(path, mf.MAX_BYTES + 1) as f:
                raw = f.read(mf.MAX_BYTES + 1)
        except FileNotFoundError:
            raise CorruptRemote(name, "no manifest.json (the upload did not finish)") from None
        except safeio.UnsafeFile as e:
            raise CorruptRemote(name, f"manifest.json {e.strerror}") from None
        except Exception as e:
            raise self._error(f"cannot read {name}/manifest.json", e) from None
        if len(raw) > mf.MAX_BYTES:
            raise CorruptRemote(name, f"manifest.json is larger than {mf.MAX_BYTES >> 20} MiB: "
                                "not an rtrain manifest")
        return raw

    def read_manifest(self, name: str) -> dict:
        """The parsed and shape-checked manifest of `name` (`CorruptRemote` with the reason)."""
        return self._parse(name, self.read_manifest_bytes(name))

    def _parse(self, name: str, raw: bytes) -> dict:
        try:
            m = mf.parse(raw)
        except mf.ManifestError as e:
            raise CorruptRemote(name, str(e)) from None
        if m["step"] != self._step(name):
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
            with self._open_read(self._path(name, member), CHUNK) as f:
                while n <= size:
                    chunk = f.read(min(CHUNK, size + 1 - n))
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
            raise self._error(f"cannot read {name}/{member}", e) from None
        return n

    def _sync(self, path: str, *, directory: bool = False) -> None:
        """On a filesystem mirror, what was written reaches the disk before the manifest."""
        if not self.local:
            return
        fd = os.open(os.path.dirname(path) if directory else path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _rm(self, path: str, what: str, *, recursive: bool = False) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise self._error(what, e) from None

    def upload(self, local: Path, *, parallel: int = 4) -> Transfer:
        """Upload the committed checkpoint dir `local` (`transfer.upload`)."""
        return transfer.upload(self, local, parallel=parallel)

    def download(self, name: str, ckpt_dir: Path, *, key: bytes | None = None,
                 cache: BlobCache | None = None, file_mode: int = 0o600,
                 parallel: int = 4) -> Transfer:
        """Download `name` into `ckpt_dir/name` (`transfer.download`)."""
        return transfer.download(self, name, ckpt_dir, key=key, cache=cache,
                                 file_mode=file_mode, parallel=parallel)

    # -- delete and probe -----------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Remove checkpoint `name`: manifest.json first (from then on it is no checkpoint
        anyone resumes from), then the rest."""
        self._step(name)
        self._rm(self._path(name, layout.MANIFEST), f"cannot delete {name}/manifest.json")
        self._rm(self._path(name), f"cannot delete {name}", recursive=True)

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
                raise self._error(what, e) from None
            if what == "cannot read back" and result != data:
                raise MirrorError(f"mirror {self.display}: read back other bytes than were "
                                  "written: check the endpoint (AWS_ENDPOINT_URL)")


