"""A mirror of checkpoints at an fsspec URL, so a run can resume on a fresh machine.

Remote layout, the local one without temp names (docs/design.md, "Mirror"):

    <url>/checkpoint-<step>/<every file the manifest lists>
    <url>/checkpoint-<step>/manifest.json      uploaded last: the commit marker

A remote checkpoint exists when its manifest.json does; a directory without one is an upload
that did not finish (`RemoteCheckpoint.committed` False), never downloaded. Uploads hash every
local file just before the backend's put sends it and refuse a file that differs from the local
manifest (`CorruptLocal`); downloads fetch with the backend's get into a temp dir, hash the
bytes on disk and rename into place only when every file matches (`CorruptRemote` otherwise),
exactly like a local commit.

fsspec (and the protocol's backend, s3fs for `s3://`) is imported only by `open_mirror`:
`rtrain inspect DIR` never pays for it. Credentials and endpoint come only from the backend's
own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_ENDPOINT_URL / AWS_PROFILE for S3);
no message shows them, and `display` is the URL without `user:pass@` or query.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor import filemode
from supervisor.ckpt import hashing, layout, safeio
from supervisor.ckpt import manifest as mf
from supervisor.ckpt.commit import fsync_dir
from supervisor.ckpt.verify import Level, check_member_name, verify
from supervisor.errors import RtrainError
from supervisor.remote import cache as blobs
from supervisor.remote.url import redact, scheme

# S3 timeouts and retries, so that a dead endpoint fails an operation instead of hanging it:
# - one that refuses or never accepts the connection: BOTOCORE_ATTEMPTS x CONNECT_TIMEOUT_S
#   (15 s; s3fs does not retry connection errors);
# - one that accepts and then stalls: each read waits READ_TIMEOUT_S, retried by botocore and
#   again by s3fs: at most S3FS_RETRIES x BOTOCORE_ATTEMPTS x 60 s (6 min) plus backoff.
# 60 s, not less: a slow store may legitimately pause that long before answering a large PUT.
# Uploads go without "Expect: 100-continue" (`_no_expect_continue`), or the stalled case would
# have no bound at all.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 60
BOTOCORE_ATTEMPTS = 3  # botocore "standard" retry mode: throttling and transient 5xx too
S3FS_RETRIES = 2  # s3fs's loop around each call: timeouts, connections dropped mid-body

CHUNK = 8 << 20
"""Bytes read or written per call while hashing or streaming (one buffer per file in flight)."""
PART_BYTES: int | None = None
"""Multipart part size handed to the backend's put_file; None: its own choice (s3fs: 50 MiB
parts, more for files past 500 GiB to stay within S3's 10,000 parts; a file of twice the
part size or more goes in parts, 10 at a time)."""
PROBE_PREFIX = ".rtrain-probe-"

_S3 = ("s3", "s3a")
_EXTRA = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class MirrorError(RtrainError):
    """The mirror cannot be used as asked; str() is one line saying what to change."""


class CorruptRemote(MirrorError):
    """A remote checkpoint whose manifest or files cannot be trusted; nothing was kept."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


class Unreachable(MirrorError):
    """The endpoint does not answer (refused, timed out, dropped): perhaps for a while only."""


class CorruptLocal(MirrorError):
    """A local checkpoint that fails its own manifest: it is not uploaded."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason} (not uploaded)")
        self.name = name
        self.reason = reason


@dataclass(frozen=True)
class RemoteCheckpoint:
    step: int
    name: str
    committed: bool
    """manifest.json is present (else an upload that did not finish)."""


@dataclass(frozen=True)
class Transfer:
    name: str
    bytes: int
    """Bytes sent or received over the network."""
    seconds: float
    files: int
    """Files sent or received over the network."""
    cached_bytes: int = 0
    """Bytes a download took from local blobs (cache or checkpoints) instead."""


def open_mirror(url: str, *, file_mode: int = filemode.DEFAULT_FILE_MODE) -> Mirror:
    """The mirror at `url`: `s3://bucket/prefix`, `gs://...`, `file:///path`, or a plain path
    (a shared filesystem). Nothing is contacted yet (`Mirror.probe` does)."""
    display = redact(url)
    protocol = scheme(url) or "file"
    extra = _EXTRA.get(protocol, "s3")
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise MirrorError(f"mirror {display}: fsspec is not installed (every mirror needs it, a "
                          f"local directory too): pip install 'rtrain[{extra}]'") from None
    if protocol == "file":
        from fsspec.implementations.local import LocalFileSystem

        path = url[len("file://"):] if scheme(url) else url
        if not path:
            raise MirrorError("mirror file://: name a directory, e.g. file:///shared/ckpts")
        root = os.path.abspath(os.path.expanduser(path))
        return Mirror(url, LocalFileSystem(auto_mkdir=True), root, local=True,
                      file_mode=file_mode)
    if protocol in _S3:
        try:
            import s3fs
        except ImportError:
            raise MirrorError(f"mirror {display}: s3fs is not installed: pip install "
                              "'rtrain[s3]'") from None
        from aiobotocore.session import AioSession

        session = AioSession()  # the standard chain: environment, profiles, instance role
        session.register("before-call.s3", _no_expect_continue)  # after botocore's own
        fs = s3fs.S3FileSystem(
            session=session,
            skip_instance_cache=True,  # credentials are read when the mirror is opened
            use_listings_cache=False,  # another machine may have changed the prefix
            config_kwargs={
                "connect_timeout": CONNECT_TIMEOUT_S,
                "read_timeout": READ_TIMEOUT_S,
                "retries": {"max_attempts": BOTOCORE_ATTEMPTS, "mode": "standard"},
            },
        )
        fs.retries = S3FS_RETRIES
    else:
        from fsspec.core import url_to_fs

        try:
            fs, _ = url_to_fs(url, skip_instance_cache=True)
        except ImportError:
            raise MirrorError(f"mirror {display}: the {protocol}:// backend is not installed: "
                              f"pip install 'rtrain[{extra}]'") from None
        except ValueError:
            raise MirrorError(f"mirror {display}: unknown protocol {protocol!r}: use s3://, "
                              "gs://, file:// or a directory path") from None
    if redact(url) != url.split("?", 1)[0].split("#", 1)[0]:
        raise MirrorError(f"mirror {display}: credentials in the URL are not read: set them in "
                          "the backend's environment (AWS_ACCESS_KEY_ID / "
                          "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and leave them out of the URL")
    root = fs._strip_protocol(url).rstrip("/")
    if not root:
        raise MirrorError(f"mirror {display}: name a bucket, e.g. {protocol}://bucket/prefix")
    return Mirror(url, fs, root, local=False)


def _no_expect_continue(params: dict, **_: Any) -> None:
    """botocore asks for "100 Continue" before every upload body; aiohttp waits for that answer
    with no timeout at all (read_timeout does not cover it), so an endpoint that accepts the
    connection and never answers would hang an upload forever. Sent without the header, the
    body goes at once and the read timeout bounds the wait for the response."""
    params.get("headers", {}).pop("Expect", None)


def checkpoints(inventory: dict[str, dict[str, int]]) -> list[RemoteCheckpoint]:
    """The checkpoints of a `Mirror.inventory()`, newest first."""
    out = [RemoteCheckpoint(layout.parse_step(n), n, layout.MANIFEST in files)
           for n, files in inventory.items()]
    return sorted(out, key=lambda r: r.step, reverse=True)


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


_UNREACHABLE = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                          "ConnectionError", "TimeoutError", "ClientConnectorError",
                          "ServerDisconnectedError"})


def _names(exc: BaseException) -> set[str]:
    """Class names along the exception's chain, bases included."""
    return {cls.__name__ for e in _chain(exc) for cls in type(e).__mro__}


def explain(exc: BaseException, *, local: bool = False) -> str:
    """`(kind): what to check` for a storage error, from exception classes and S3 error codes
    only: an error's own text may quote request details, never shown. `local`: the mirror is a
    filesystem path (permissions, not credentials)."""
    chain = _chain(exc)
    names = _names(exc)
    codes = [e.response.get("Error", {}).get("Code") for e in chain
             if isinstance(getattr(e, "response", None), dict)]
    kind = next((c for c in codes if c), None) or type(exc).__name__
    if "NoCredentialsError" in names or "PartialCredentialsError" in names:
        return (f"({kind}): no credentials found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE")
    if names & _UNREACHABLE:
        return (f"({kind}): the endpoint does not answer: check AWS_ENDPOINT_URL (or the "
                "region) and the network")
    if "PermissionError" in names or set(codes) & {
            "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden"}:
        if local:
            return f"({kind}): check the directory's owner and permissions"
        return (f"({kind}): check AWS credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE) / bucket policy")
    if "FileNotFoundError" in names or "NoSuchBucket" in codes:
        return f"({kind}): check the {'path' if local else 'bucket name and prefix'}"
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        return f"({kind}: {exc.strerror})"
    return f"({kind})"


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

    def _path(self, name: str, member: str | None = None) -> str:
        return f"{self.root}/{name}" if member is None else f"{self.root}/{name}/{member}"

    def _error(self, what: str, exc: BaseException) -> MirrorError:
        cls = Unreachable if _names(exc) & _UNREACHABLE else MirrorError
        return cls(f"mirror {self.display}: {what} {explain(exc, local=self.local)}")

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

    # -- upload ---------------------------------------------------------------------------

    def upload(self, local: Path, *, parallel: int = 4) -> Transfer:
        """Upload the committed checkpoint dir `local`: every file its manifest lists, hashed
        just before it is sent, `parallel` at a time; then manifest.json. An unfinished remote
        copy is overwritten; an identical committed one is left as it is (0 bytes sent); a different
        committed one (the run rolled back and saved that step again) is decommitted first,
        so no reader ever sees its manifest beside the new files."""
        t0 = time.monotonic()
        local = Path(local)
        name = local.name
        self._step(name)
        try:
            raw = safeio.read_limited(local / layout.MANIFEST, mf.MAX_BYTES)
            m = mf.parse(raw)
            alg = hashing.manifest_alg(m, None)
            files = [(check_member_name(local, member), member, entry)
                     for member, entry in m["files"].items()]
        except FileNotFoundError:
            raise CorruptLocal(name, "no manifest.json (the save did not finish)") from None
        except (mf.ManifestError, hashing.HashAlgError) as e:
            raise CorruptLocal(name, str(e)) from None
        except OSError as e:
            raise CorruptLocal(name, f"cannot read manifest.json: {e.strerror or e}") from None
        if self._remote_manifest_is(name, raw):
            return Transfer(name, 0, time.monotonic() - t0, 0)
        self._rm(self._path(name, layout.MANIFEST), f"cannot decommit {name}")
        if self.local:  # private before the first byte lands in it
            filemode.make_dir(Path(self._path(name)), self.file_mode)
        sent = _run_all(parallel, [
            (self._put, (src, name, member, entry, alg)) for src, member, entry in files])
        try:
            self.fs.pipe_file(self._path(name, layout.MANIFEST), raw)
        except Exception as e:
            raise self._error(f"cannot write {name}/manifest.json", e) from None
        if self.local:
            filemode.apply_tree(Path(self._path(name)), self.file_mode)
        self._sync(self._path(name, layout.MANIFEST), directory=True)
        return Transfer(name, sum(sent) + len(raw), time.monotonic() - t0, len(files) + 1)

    def _remote_manifest_is(self, name: str, raw: bytes) -> bool:
        try:
            return self.read_manifest_bytes(name) == raw
        except CorruptRemote:
            return False

    def _put(self, src: Path, name: str, member: str, entry: dict, alg: str) -> int:
        size = entry["size"]
        dest = self._path(name, member)
        h = hashing.new_hasher(alg)
        n = 0
        try:
            f = safeio.open_regular(src, follow_symlinks=True, buffering=0)
        except FileNotFoundError:
            raise CorruptLocal(name, f"{member}: missing") from None
        except OSError as e:
            raise CorruptLocal(name, f"{member}: {e.strerror or e}") from None
        with f:
            if (actual := os.fstat(f.fileno()).st_size) != size:
                raise CorruptLocal(name, f"{member}: has {actual} bytes, the manifest says "
                                   f"{size} (truncated or rewritten)")
            buf = bytearray(max(1, min(CHUNK, size)))
            view = memoryview(buf)
            while k := f.readinto(buf):
                h.update(view[:k])
                n += k
        if n != size or h.hexdigest() != entry["hash"]:
            raise CorruptLocal(name, f"{member}: hash mismatch (changed since the save: the "
                               "local checkpoint is damaged)")
        # Hashed just before it is sent (from the page cache, at memory speed), then handed to
        # the backend's own put, which sends large files in concurrent parts: streaming our
        # reads through a write handle sent the parts one by one, at 0.6x a plain put.
        try:
            self.fs.put_file(str(src), dest,
                             **({} if self.local or PART_BYTES is None
                                else {"chunksize": PART_BYTES}))
        except Exception as e:
            raise self._error(f"cannot write {name}/{member}", e) from None
        self._sync(dest)
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

    # -- download -------------------------------------------------------------------------

    def download(self, name: str, ckpt_dir: Path, *, key: bytes | None = None,
                 cache: blobs.BlobCache | None = None, file_mode: int = 0o600,
                 parallel: int = 4) -> Transfer:
        """Download `name` into `ckpt_dir/name` by the local commit protocol. Files whose
        content is already here (a local checkpoint or `cache`) are linked or copied instead;
        every file is hashed either way. A `checkpoint-<step>` already in `ckpt_dir` that
        verifies is kept (nothing replaced)."""
        t0 = time.monotonic()
        step = self._step(name)
        raw = self.read_manifest_bytes(name)
        m = self._parse(name, raw)
        try:
            mf.check_signature(m, key)
            alg = hashing.manifest_alg(m, key)
        except (mf.ManifestError, hashing.HashAlgError) as e:
            raise CorruptRemote(name, f"manifest.json: {e}") from None
        ckpt_dir = Path(ckpt_dir)
        final = ckpt_dir / name
        total = sum(e["size"] for e in m["files"].values())
        if os.path.lexists(final):
            self._keep_existing(final, key)
            return Transfer(name, 0, time.monotonic() - t0, 0, cached_bytes=total)
        filemode.make_dir(ckpt_dir, file_mode)
        sources = blobs.local_blobs(ckpt_dir)
        tmp = ckpt_dir / layout.tmp_name(step)
        os.mkdir(tmp, 0o700)  # nobody else looks in while it is written
        try:
            try:
                members = [(check_member_name(tmp, member), member, entry)
                           for member, entry in m["files"].items()]
            except mf.ManifestError as e:
                raise CorruptRemote(name, str(e)) from None
            got = _run_all(parallel, [
                (self._fetch, (dest, name, member, entry, alg, sources, cache))
                for dest, member, entry in members])
            fd = os.open(tmp / layout.MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
                f.flush()
                os.fsync(f.fileno())
            filemode.apply_tree(tmp, file_mode)
            fsync_dir(tmp)
            if os.path.lexists(final):  # another process downloaded it meanwhile
                self._keep_existing(final, key)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                os.replace(tmp, final)
                fsync_dir(ckpt_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        net = [n for n, _ in got]
        return Transfer(name, sum(net) + len(raw), time.monotonic() - t0,
                        sum(1 for n in net if n) + 1, cached_bytes=sum(c for _, c in got))

    def _keep_existing(self, final: Path, key: bytes | None) -> None:
        v = verify(final, Level.FULL, key)
        if not v.ok:
            raise MirrorError(f"{final.name} is already in {final.parent} and fails "
                              f"verification ({v.reason}): move it away to download the "
                              "mirror's copy")

    def _fetch(self, dest: Path, name: str, member: str, entry: dict, alg: str,
               sources: dict[tuple[str, str], Path],
               cache: blobs.BlobCache | None) -> tuple[int, int]:
        """Put one file at `dest`, checked; returns (bytes downloaded, bytes from local)."""
        size, want = entry["size"], entry["hash"]
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        here = sources.get((alg, want))
        for get in ((lambda: here is not None and blobs.place(here, dest)),
                    (lambda: cache is not None and cache.get(alg, want, dest))):
            if get():
                try:
                    ok = (os.stat(dest).st_size == size
                          and hashing.hash_file(dest, alg) == want)
                except OSError:
                    ok = False
                if ok:
                    if cache is not None:
                        cache.add(alg, want, dest)
                    return 0, size
                dest.unlink(missing_ok=True)  # a damaged blob: fetch the real bytes
        remote = self._path(name, member)
        try:
            if self.local:  # a FIFO or device under a listed name: never opened (get would)
                safeio.check_regular(remote, follow_symlinks=True)
            n = self.fs.size(remote)
        except FileNotFoundError:
            raise CorruptRemote(name, f"{member}: missing") from None
        except safeio.UnsafeFile as e:
            raise CorruptRemote(name, f"{member} {e.strerror}") from None
        except Exception as e:
            raise self._error(f"cannot read {name}/{member}", e) from None
        if n != size:  # checked first: a mirror cannot make us fill the disk
            raise CorruptRemote(name, f"{member}: has {n} bytes, the manifest says {size} "
                                "(truncated or rewritten)")
        # The backend's own get (one streamed request; concurrent parts where it has them),
        # then the bytes that landed on disk are hashed from the page cache and compared: what
        # is verified is exactly what the resume will read. Streaming our own reads through a
        # hasher made one ranged request per chunk, at half a plain get's rate.
        try:
            self.fs.get_file(remote, str(dest))
        except FileNotFoundError:
            raise CorruptRemote(name, f"{member}: missing") from None
        except Exception as e:
            raise self._error(f"cannot read {name}/{member}", e) from None
        filemode.set_mode(dest, 0o600)
        with safeio.open_regular(dest, buffering=0) as f:
            h = hashing.new_hasher(alg)
            got = 0
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while k := f.readinto(buf):
                h.update(view[:k])
                got += k
            os.fsync(f.fileno())
        if got != size:
            raise CorruptRemote(name, f"{member}: has {got} bytes, the manifest says {size} "
                                "(truncated or rewritten)")
        if h.hexdigest() != want:
            raise CorruptRemote(name, f"{member}: hash mismatch (the mirror's bytes differ "
                                "from its manifest)")
        if cache is not None:
            cache.add(alg, want, dest)
        return n, 0

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


def _run_all(parallel: int, calls: list[tuple[Any, tuple]]) -> list:
    """Results of `fn(*args)` for each call, `parallel` at a time; the first error is raised
    after cancelling what has not started."""
    if not calls:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(calls)))) as pool:
        futures = [pool.submit(fn, *args) for fn, args in calls]
        try:
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
