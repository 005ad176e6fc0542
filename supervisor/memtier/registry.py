"""How the nodes of a multi-node run find each other's peer servers: files in the checkpoint dir.

Every node of a multi-node run writes the same checkpoint dir (a shared filesystem), so that is
where each node's rtrain says where its peer server listens:

    <ckpt-dir>/.rtrain-peers/<node>.json    {"v": 1, "node", "host", "port", "run", "updated",
                                             "mac"}

`register` rewrites the file atomically (a reader sees the old entry or the new, never half)
and is called again every few seconds: `updated` is the writer's unix time, and an entry not
refreshed within `STALE_S` is a node that is gone (a node lost whole cannot remove its own
file). This compares clocks of different machines, so it assumes they agree within seconds
(NTP), as the rest of a multi-node run does.

Each node copies the parts of its ring predecessor (`source_of`: the nodes sorted by id, each
taking the one before it, the first the last), so every node's parts are held by exactly one
other node while the ring is whole, and a node that joins or leaves changes the sources of its
neighbours only.

The files are data anyone who can write the checkpoint dir may have written. The registry dir
is opened once per use without following a link (`_opened`), and every entry relative to that
descriptor (`_open_entry`): no link is followed, only regular files are read, never blocking on
a FIFO, with a size limit and bounded parsing, and nothing outside the directory is ever
removed or written (a link or a file planted at `.rtrain-peers` is refused with one line and
the launch goes without peer copies). An entry that does not parse or check is ignored, not
fatal. `mac` is an HMAC of the entry under the run's secret: the peer side reads only entries
that carry it, so an entry someone else wrote cannot take a node's place in the ring. Still,
the peer's handshake (`peerwire.py`) is what proves a node belongs to the run: an entry can
be replayed after its node is gone, and its port taken by anyone.

A run without a signing key still authenticates its peers: `run_secret` gives the run's peer
key, 32 random bytes that the first node to start writes to `<ckpt-dir>/.rtrain-peers/
run-<run>.key` (0600, created exclusively, so every node reads the first one's) and that every
node of the run reads from there. A key file that is a link, not this user's own or readable
by others is refused: the key is as secret as the checkpoint dir's owner-only files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import math
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import runid, safeio
from rtrain.supervisor.core import filemode
from rtrain.supervisor.core.ownfiles import RefusedFile, describe

REGISTRY = ".rtrain-peers"
STALE_S = 30.0
VERSION = 1
_MAX_BYTES = 64 << 10
_NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_SUFFIX = ".json"
_KEY_BYTES = 32
_ENTRY_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class Node:
    node: str
    """Unique per launch (`node_id`); the registry file's name."""
    host: str
    """Where its peer server listens: an address the other nodes can reach."""
    port: int
    run: str | None
    updated: float
    """Unix time of its last `register`."""


def node_id() -> str:
    """`<hostname>-<pid>-<4 hex>`: unique per launch, also for two launches on one host and a
    pid reused after a restart."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:150].lstrip(".-") or "host"
    return f"{host}-{os.getpid()}-{os.urandom(2).hex()}"


def _name(node: str) -> str:
    if not _NODE.fullmatch(node):
        raise ValueError(f"not a node id: {node!r:.80}")
    return f"{node}{_SUFFIX}"


@contextlib.contextmanager
def _opened(ckpt_dir: Path, *, create: bool) -> Iterator[int | None]:
    """The registry dir's descriptor (None when it is absent and not created): the one way
    into it, so that every use of it is relative to the directory itself, never to whatever a
    link planted at its name points to. RefusedFile for a link or anything but a directory."""
    path = Path(ckpt_dir) / REGISTRY
    if create:
        Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except FileNotFoundError:
        if create:
            raise
        yield None
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise e from None
        if stat.S_ISLNK(st.st_mode):
            raise RefusedFile(path, "is a symbolic link, which rtrain never follows") from None
        raise RefusedFile(path, f"is {describe(st.st_mode)}, not a directory") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _open_entry(dfd: int, name: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file `name` in the registry dir `dfd`: never through a link,
    never blocking on a FIFO, never a device (RefusedFile). With O_CREAT, O_EXCL is implied:
    only a file that was not there is created."""
    if flags & os.O_CREAT:
        flags |= os.O_EXCL
    try:
        fd = os.open(name, flags | _ENTRY_FLAGS, mode, dir_fd=dfd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.EEXIST):
            raise
        try:  # a link (ELOOP), a socket (ENXIO), a directory (EISDIR): say which
            kind = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except OSError:
            raise e from None
        if stat.S_ISREG(kind):
            raise
        raise RefusedFile(f"{REGISTRY}/{name}", f"is {describe(kind)}, which rtrain never "
                                                "opens") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise RefusedFile(f"{REGISTRY}/{name}", f"is {describe(st.st_mode)}, not a regular file")
    return fd


def _read_entry(dfd: int, name: str, limit: int) -> tuple[bytes, os.stat_result]:
    fd = _open_entry(dfd, name)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise RefusedFile(f"{REGISTRY}/{name}", f"is {st.st_size} bytes, more than an "
                                                    f"entry ever holds ({limit})")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise RefusedFile(f"{REGISTRY}/{name}", f"is more than an entry ever holds ({limit})")
    return data, st


def _write_new(dfd: int, name: str, data: bytes, mode: int, *, replace: bool) -> None:
    """`data` at `name` in the registry dir, through a temp file created there exclusively:
    renamed over `name` (`replace`), or linked to it only where there is none (the first
    writer wins, FileExistsError for the others)."""
    tmp = f".{name}.{os.urandom(6).hex()}.tmp"
    fd = _open_entry(dfd, tmp, os.O_WRONLY | os.O_CREAT, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)  # exactly: the umask cut the create's
            f.write(data)
        if replace:
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        else:
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dfd)


def _entry_mac(secret: bytes, entry: dict[str, Any]) -> str:
    fields = {k: v for k, v in entry.items() if k != "mac"}
    msg = b"rtrain peer entry|" + json.dumps(fields, sort_keys=True).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def register(ckpt_dir: Path, node: Node, *, now: float | None = None,
             mode: int = filemode.DEFAULT_FILE_MODE, secret: bytes | None = None) -> None:
    """Publish (or refresh) `node`; its `updated` becomes `now` (default: the clock). With the
    run's `secret`, the entry carries a MAC (`live_nodes`)."""
    entry: dict[str, Any] = {"v": VERSION, "node": node.node, "host": node.host,
                             "port": node.port, "run": node.run,
                             "updated": time.time() if now is None else now}
    if secret is not None:
        entry["mac"] = _entry_mac(secret, entry)
    name = _name(node.node)
    # Not durable: rewritten every few seconds, and stale anyway after a power cut.
    with _opened(ckpt_dir, create=True) as dfd:
        assert dfd is not None
        _write_new(dfd, name, (json.dumps(entry) + "\n").encode(), mode, replace=True)


def unregister(ckpt_dir: Path, node: str) -> None:
    name = _name(node)
    with _opened(ckpt_dir, create=False) as dfd:
        if dfd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)


FORGET_S = 3600.0


def forget_stale(ckpt_dir: Path, now: float, older_s: float = FORGET_S) -> int:
    """Remove entries not refreshed for `older_s` (by the file's mtime): nodes lost whole,
    which cannot remove their own, would otherwise pile up over a long run's launches.
    Returns how many went. Only entries of the registry dir itself: RefusedFile when a link
    or a file is planted at its name."""
    gone = 0
    with _opened(ckpt_dir, create=False) as dfd:
        if dfd is None:
            return 0
        with os.scandir(dfd) as entries:
            # Temp files too: those of an rtrain killed between the write and the rename.
            old = [e.name for e in entries
                   if e.name.endswith((_SUFFIX, ".tmp")) and e.is_file(follow_symlinks=False)
                   and now - e.stat(follow_symlinks=False).st_mtime > older_s]
        for name in old:
            try:
                os.unlink(name, dir_fd=dfd)
                gone += 1
            except OSError:
                pass
    return gone


def live_nodes(ckpt_dir: Path, run: str | None, now: float, secret: bytes | None = None
               ) -> list[Node]:
    """The nodes of `run` refreshed within STALE_S of `now`, sorted by node id. Files that do
    not read or check are ignored, and with the run's `secret` so is an entry without its MAC
    (one written by someone else: it would take a node's place in the ring, and that node's
    parts would go uncopied). RefusedFile when a link or a file is planted at the registry
    dir's name."""
    nodes = []
    with _opened(ckpt_dir, create=False) as dfd:
        if dfd is None:
            return []
        with os.scandir(dfd) as entries:
            names = [e.name for e in entries]
        for name in names:
            stem = name.removesuffix(_SUFFIX)
            if stem == name or not _NODE.fullmatch(stem):
                continue  # temp files, key files, and anything else
            node = _read(dfd, name, stem, secret)
            if node is not None and node.run == run and now - node.updated <= STALE_S:
                nodes.append(node)
    nodes.sort(key=lambda n: n.node)
    return nodes


def _read(dfd: int, name: str, stem: str, secret: bytes | None) -> Node | None:
    try:
        raw, _ = _read_entry(dfd, name, _MAX_BYTES)  # no link, FIFO or device followed
        entry = safeio.parse_json(raw)
    except (OSError, ValueError):
        return None
    if secret is not None and not (
            isinstance(entry, dict) and isinstance(entry.get("mac"), str)
            and hmac.compare_digest(entry["mac"].encode(), _entry_mac(secret, entry).encode())):
        return None
    return _as_node(entry, stem)


def run_secret(ckpt_dir: Path, run: str | None) -> bytes:
    """The run's peer key (the module's docstring): read, or made by the first node. Raises
    RefusedFile for a registry dir or key file rtrain must not use."""
    name = f"run-{run or 'none'}.key"
    shown = Path(ckpt_dir) / REGISTRY / name
    with _opened(ckpt_dir, create=True) as dfd:
        assert dfd is not None
        for _ in range(3):
            try:
                raw, st = _read_entry(dfd, name, 2 * _KEY_BYTES + 1)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    _write_new(dfd, name, os.urandom(_KEY_BYTES).hex().encode() + b"\n",
                               0o600, replace=False)
                continue
            except RefusedFile as e:
                raise RefusedFile(shown, e.reason) from None
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RefusedFile(shown, f"(the run's peer key) is not this user's alone "
                                         f"(owner uid {st.st_uid}, mode "
                                         f"{stat.S_IMODE(st.st_mode):04o})")
            try:
                key = bytes.fromhex(raw.decode("ascii").strip())
            except (UnicodeDecodeError, ValueError):
                key = b""
            if len(key) != _KEY_BYTES:
                raise RefusedFile(shown, "is not a peer key rtrain wrote")
            return key
    raise RefusedFile(shown, "keeps appearing and disappearing")


def _as_node(entry: Any, stem: str) -> Node | None:
    if not isinstance(entry, dict) or entry.get("v") != VERSION or entry.get("node") != stem:
        return None
    host, port, run, updated = (entry.get(k) for k in ("host", "port", "run", "updated"))
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    if run is not None and not runid.valid(run):
        return None
    if not isinstance(updated, (int, float)) or isinstance(updated, bool) \
            or not math.isfinite(updated):
        return None
    return Node(stem, host, port, run, float(updated))


def source_of(nodes: list[Node], me: str) -> Node | None:
    """The node `me` copies from: its predecessor in the ring of `nodes` sorted by node id
    (the first node's is the last); never `me`; None when no other node is there. `me` need
    not be among `nodes` (not registered yet): its place in the order counts."""
    others = sorted((n for n in nodes if n.node != me), key=lambda n: n.node)
    if not others:
        return None
    before = [n for n in others if n.node < me]
    return before[-1] if before else others[-1]
