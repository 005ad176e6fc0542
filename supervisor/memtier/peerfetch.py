"""Copying a part from a peer node's memory tier (the client of `peerserver.py`).

`list_remote` asks a peer which parts it holds; `fetch_part` copies one of them into this node's
memory dir. Nothing a peer sends is trusted: the part's manifest is checked as
`checkpoint/verify.py` checks one (shape, signature under the run's key, hash algorithm), and must
be of this run, of the rank and step asked for, and the very manifest the listing gave; every file
is hashed as it is received and compared with the manifest (size before a byte of it is read, hash
at its end). Only then is the part renamed into place, so `dest` either does not exist or holds a
part whose every byte matches its manifest: a torn transfer, a peer that went silent or a file
changed on the peer leaves nothing behind.

The copy goes into a temp dir beside `dest` (`layout.tmp_name`), directories 0700 and files
0600 (the memory dir is the run's user's alone); fsynced only when asked (shared memory does
not outlive the machine, a disk does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing, parts, runid
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.commit import fsync_dir
from rtrain.checkpoint.layout import MANIFEST, tmp_name
from rtrain.checkpoint.verify import check_name
from rtrain.supervisor.memtier import peerwire
from rtrain.supervisor.memtier.peerwire import (
    CHUNK,
    LIST_LIMIT,
    REQUEST_LIMIT,
    NoRoom,
    PeerBusy,
    PeerError,
    PeerRefused,
    PeerUnreachable,
    Wire,
    no_delay,
)

__all__ = ["NoRoom", "PeerBusy", "PeerError", "PeerRefused", "PeerUnreachable", "RemotePart",
           "Session", "fetch_part", "list_remote"]


@dataclass(frozen=True)
class RemotePart:
    """A part as a peer listed it (`parts.Part` without the peer's path)."""

    rank: int
    step: int
    world_size: int
    origin: str
    bytes: int
    manifest: dict[str, Any]


class Session:
    """An authenticated connection to a peer (`with Session(...) as s:`); the building block
    of `list_remote` and `fetch_part`, and what tests use to send requests of their own."""

    def __init__(self, addr: tuple[str, int], run: str | None, key: bytes | None, *,
                 secret: bytes | None = None, timeout_s: float = 10.0) -> None:
        """`key`: the run's signing key; `secret`: what the handshake proves (default `key`,
        as on the server). There is no session without a secret."""
        secret = key if secret is None else secret
        if not secret:
            raise ValueError("a peer session needs the run's secret (a signing key or a "
                             "per-run key)")
        self.who = f"peer {addr[0]}:{addr[1]}"
        try:
            sock = socket.create_connection(addr, timeout=timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"cannot connect to {self.who}: no answer within "
                                  f"{timeout_s:g} s") from None
        except OSError as e:
            raise PeerUnreachable(f"cannot connect to {self.who}: {e.strerror or e}") from None
        no_delay(sock)
        self.wire = Wire(sock, timeout_s, self.who)
        try:
            self._handshake(run, secret)
        except BaseException:
            sock.close()
            raise

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.wire.sock.close()

    def _handshake(self, run: str | None, secret: bytes) -> None:
        greet = self._reply("its greeting")
        if greet.get("ok") is False:
            error = peerwire.one_line(greet.get("error"))
            raise (PeerBusy if greet.get("busy") else PeerRefused)(
                f"{self.who} refused the connection: {error}")
        if greet.get("rtrain_peer") != peerwire.PROTOCOL:
            raise PeerRefused(f"{self.who} does not speak rtrain's peer protocol "
                              f"{peerwire.PROTOCOL}")
        if greet.get("run") != run:
            raise PeerRefused(f"{self.who} serves run {_short(greet.get('run'))}, not this run "
                              f"({runid.short(run)})")
        server_nonce = greet.get("nonce")
        if not peerwire.valid_nonce(server_nonce):
            raise PeerRefused(f"{self.who} sent no nonce (32 hex digits)")
        nonce = peerwire.new_nonce()
        session = peerwire.session_key(secret, run, server_nonce, nonce)
        self.wire.send_line({"run": run, "nonce": nonce,
                             "proof": peerwire.proof(session, "client")})
        answer = self._reply("its answer to the handshake")
        if answer.get("ok") is not True:
            error = peerwire.one_line(answer.get("error"))
            if answer.get("busy"):
                raise PeerBusy(f"{self.who} refused the connection: {error}")
            raise PeerRefused(f"{self.who} refused this node: {error}")
        if not peerwire.proof_ok(session, "server", answer.get("proof")):
            raise PeerRefused(f"{self.who} does not prove it holds the run's secret (its "
                              "answer to this connection's nonces does not match)")
        self.wire.seal(session, sending=peerwire.TO_SERVER, receiving=peerwire.TO_CLIENT)

    def request(self, req: dict[str, Any], limit: int = REQUEST_LIMIT) -> dict[str, Any]:
        self.wire.send_line(req)
        return self._reply("its reply", limit)

    def _reply(self, what: str, limit: int = REQUEST_LIMIT) -> dict[str, Any]:
        reply = self.wire.read_line(limit, what)
        assert reply is not None  # eof_ok is off: an end of connection raised
        return reply

    def list(self) -> list[RemotePart]:
        reply = self.request({"op": "list"}, LIST_LIMIT)
        if "error" in reply:
            raise PeerRefused(f"{self.who} would not list: {peerwire.one_line(reply['error'])}")
        listing = reply.get("parts")
        if not isinstance(listing, list):
            raise PeerRefused(f"{self.who} sent a listing without parts")
        return [_remote_part(entry, self.who) for entry in listing]

    def open_file(self, part: RemotePart, name: str) -> int:
        """Ask for one file of `part`; returns its size, the bytes to read next (`chunks`)."""
        reply = self.request({"op": "get", "rank": part.rank, "step": part.step,
                              "origin": part.origin, "file": name})
        if "error" in reply:
            raise PeerRefused(f"{name}: {self.who} would not send it: "
                              f"{peerwire.one_line(reply['error'])}")
        size = reply.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PeerRefused(f"{name}: {self.who} sent no size")
        return size

    def chunks(self, size: int, name: str) -> Iterator[memoryview]:
        """The `size` bytes that follow `open_file`, a chunk at a time (one buffer reused)."""
        buf = bytearray(min(CHUNK, max(1, size)))
        view = memoryview(buf)
        left = size
        while left:
            piece = view[:min(left, len(buf))]
            self.wire.read_into(piece, name)
            yield piece
            left -= piece.nbytes


def list_remote(addr: tuple[str, int], run: str | None, key: bytes | None, *,
                secret: bytes | None = None, timeout_s: float = 5.0) -> list[RemotePart]:
    """The parts of `run` the peer at `addr` holds, newest first. Raises PeerUnreachable or
    PeerRefused."""
    with Session(addr, run, key, secret=secret, timeout_s=timeout_s) as s:
        return s.list()


def fetch_part(addr: tuple[str, int], part: RemotePart, dest: Path, run: str | None,
               key: bytes | None, *, secret: bytes | None = None, timeout_s: float = 10.0,
               fsync: bool = False, session: Session | None = None) -> Path:
    """Copy `part` from the peer at `addr` into `dest` (its committed path, e.g.
    `parts.rank_dir(memory_dir, R, held=True) / checkpoint_name(S)`). Returns `dest`, also
    when it exists already (held). Raises PeerUnreachable, PeerRefused or NoRoom (a
    PeerRefused), with nothing left behind. `session`: an open one to that peer (the listing's:
    a copy every fraction of a second pays no second handshake)."""
    dest = Path(dest)
    if os.path.lexists(dest):
        return dest
    who = f"peer {addr[0]}:{addr[1]}"
    m = _trusted(part, run, key, who)
    alg = hashing.manifest_alg(m, key)
    tmp = dest.parent / tmp_name(part.step)
    try:
        _make_dirs(dest.parent)
        _check_room(dest.parent, part, m)  # before a byte is received
        os.mkdir(tmp, 0o700)
        opened = contextlib.nullcontext(session) if session is not None else Session(
            addr, run, key, secret=secret, timeout_s=timeout_s)
        with opened as s:
            raw = _receive_manifest(s, part)
            for name, entry in m["files"].items():
                _receive_file(s, part, name, entry, alg, tmp, fsync)
        _write(tmp / MANIFEST, raw, fsync)
        if fsync:
            fsync_dir(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.lexists(dest):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # held meanwhile: ours is not needed
            return dest
        if fsync:
            fsync_dir(dest.parent)
        return dest
    except OSError as e:  # the wire raises PeerError: an OSError here is this node's disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise NoRoom(f"cannot write the part of rank {part.rank} at step {part.step} into "
                     f"{dest.parent.name}: {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _trusted(part: RemotePart, run: str | None, key: bytes | None, who: str) -> dict[str, Any]:
    """The listing's manifest for `part`, checked as `checkpoint/verify.py` checks one, and
    naming the part asked for. Raises PeerRefused."""
    what = f"the part of rank {part.rank} at step {part.step} from {who}"
    try:
        m = mf.parse(json.dumps(part.manifest).encode())
        mf.check_signature(m, key)
        hashing.manifest_alg(m, key)
        for name in m["files"]:
            check_name(name)
    except (mf.ManifestError, hashing.HashAlgError, TypeError, ValueError) as e:
        raise PeerRefused(f"{what}: {peerwire.one_line(e)}") from None
    info = m.get("info") if isinstance(m.get("info"), dict) else {}
    if runid.of(m) != run:
        raise PeerRefused(f"{what} is of run {runid.short(runid.of(m))}, not this run "
                          f"({runid.short(run)})")
    if m["step"] != part.step or info.get("rank") != part.rank \
            or info.get("world_size") != part.world_size or not info.get("part"):
        raise PeerRefused(f"{what}: its manifest is of rank {info.get('rank')!r:.20} at step "
                          f"{m['step']} (world size {info.get('world_size')!r:.20}), not the "
                          "part asked for")
    return m


def _check_room(parent: Path, part: RemotePart, m: dict[str, Any]) -> None:
    need = sum(e["size"] for e in m["files"].values()) + len(mf.dumps(m))
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise NoRoom(f"the part of rank {part.rank} at step {part.step} needs {need} bytes, "
                     f"{parent.name} has {free} free: not copied")


def _receive_manifest(s: Session, part: RemotePart) -> bytes:
    size = s.open_file(part, MANIFEST)
    if size > mf.MAX_BYTES:
        raise PeerRefused(f"{MANIFEST}: {s.who} sends {size} bytes, more than a manifest "
                          f"may take ({mf.MAX_BYTES >> 20} MiB)")
    raw = b"".join(bytes(c) for c in s.chunks(size, MANIFEST))
    try:
        served = mf.parse(raw)
    except mf.ManifestError as e:
        raise PeerRefused(f"{MANIFEST} from {s.who}: {peerwire.one_line(e)}") from None
    if served != part.manifest:
        raise PeerRefused(f"{MANIFEST} from {s.who} is not the manifest its listing gave "
                          "(the part changed on the peer)")
    return raw


def _receive_file(s: Session, part: RemotePart, name: str, entry: dict[str, Any], alg: str,
                  tmp: Path, fsync: bool) -> None:
    size = s.open_file(part, name)
    if size != entry["size"]:
        raise PeerRefused(f"{name}: {s.who} sends {size} bytes, the manifest says "
                          f"{entry['size']} (truncated or rewritten on the peer)")
    path = tmp / name
    _make_dirs(path.parent)
    h = hashing.new_hasher(alg)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb", buffering=0) as f:
        for chunk in s.chunks(size, name):
            h.update(chunk)
            f.write(chunk)
        if fsync:
            os.fsync(f.fileno())
    if h.hexdigest() != entry["hash"]:
        raise PeerRefused(f"{name} from {s.who}: content hash does not match the manifest "
                          "(changed or damaged on the peer)")


def _write(path: Path, data: bytes, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _make_dirs(path: Path) -> None:
    """`path` and its missing parents, each 0700 (pathlib's parents=True gives them 0777)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(d, 0o700)


def _remote_part(entry: Any, who: str) -> RemotePart:
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(entry, dict):
        raise PeerRefused(f"{who} sent a listing entry that is not an object")
    rank, step, size = entry.get("rank"), entry.get("step"), entry.get("world_size")
    if not (count(rank) and count(step) and count(size) and rank < size
            and count(entry.get("bytes")) and isinstance(entry.get("manifest"), dict)
            and entry.get("origin") in (parts.OWN, parts.KEPT)):
        raise PeerRefused(f"{who} sent a malformed listing entry")
    return RemotePart(rank, step, size, entry["origin"], entry["bytes"], entry["manifest"])


def _short(run: Any) -> str:
    return run[:8] if isinstance(run, str) and run else "none"

