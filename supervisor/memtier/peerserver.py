"""Serving this node's memory-tier parts to peer nodes, read-only.

So that a node lost whole (rtrain with it) can be restored from another node's memory, every
node's rtrain serves the parts in its memory dir (`parts.list_parts`) to the nodes of its run.

Protocol, over TCP, one client per connection and as many requests on it as the client likes
(framing, bounds and the handshake's keys in `peerwire.py`):

    server  {"rtrain_peer": 2, "run": <run>, "nonce": <32 hex>}
    client  {"run": <run>, "nonce": <32 hex>, "proof": <hex>}
    server  {"ok": true, "proof": <hex>}        or {"ok": false, "error": ...}, closed
    ... from here on every frame is followed by its tag (peerwire.TAG) ...
    client  {"op": "list"}
    server  {"parts": [{"rank", "step", "world_size", "origin", "bytes", "manifest"}, ...]}
    client  {"op": "get", "rank": R, "step": S, "origin": O, "file": NAME}
    server  {"size": N} and N raw bytes, in chunks   or {"error": ...}

A client of another run, or one that does not prove it holds the run's secret, is refused.
Only this run's parts are listed, and only files of a listed part are sent: its manifest.json
or a name its manifest lists, opened with `safeio.open_beneath` from the memory dir down, so no
link anywhere on the way and nothing outside the part is ever read. A part that stopped
verifying (quick level) since it was listed is not served, with the reason. The server never
writes to the memory dir.

Whoever reaches the port can connect, so nothing is given before the handshake proves the
client one of the run's nodes: a connection not through it within `PREAUTH_S` is closed, at
most `PREAUTH_PER_ADDRESS` connections of one address (and `PREAUTH_MAX` in all) may be in
their handshake at once, more are closed at once, and a client holds one of the
`max_clients` slots only once it is authenticated. One more authenticated client is told it is
busy and closed (the client raises `PeerBusy` and tries again later). So idle or slow sockets
cost their opener a reconnect every `PREAUTH_S`, never the run's own nodes a copy; each
connection's reads and sends have deadlines (`timeout_s`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any, BinaryIO

from rtrain.checkpoint import parts, safeio
from rtrain.checkpoint.layout import MANIFEST, checkpoint_name
from rtrain.checkpoint.manifest import ManifestError
from rtrain.checkpoint.verify import Level, Status, check_name, verify
from rtrain.supervisor.memtier import peerwire
from rtrain.supervisor.memtier.peerwire import (
    CHUNK,
    LIST_LIMIT,
    REQUEST_LIMIT,
    PeerError,
    Wire,
    no_delay,
)

log = logging.getLogger(__name__)

_ACCEPT_POLL_S = 0.2  # how soon close() is noticed by the accepting thread
PREAUTH_S = 2.0
"""Time a client has to get through the handshake: a node answers in a millisecond or so."""
PREAUTH_PER_ADDRESS = 4
"""Connections of one address in their handshake at once: more are closed unanswered."""
PREAUTH_MAX = 64
"""... and of all addresses (each is a thread for at most PREAUTH_S)."""


class PeerServer:
    """This node's memory dir, served to the peers of `run`. `start()`, then `address` is
    what the registry publishes; `close()` when the launch ends."""

    def __init__(self, memory_dir: Path, run: str | None, key: bytes | None,
                 host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None,
                 timeout_s: float = 10.0, max_clients: int = 4,
                 preauth_s: float = PREAUTH_S) -> None:
        """`key`: the run's signing key (the parts' signatures); `secret`: what the handshake
        proves a client holds, default `key` (peerside.py gives the per-run key when there is
        no signing key). There is no server without a secret."""
        if max_clients < 1 or timeout_s <= 0 or preauth_s <= 0:
            raise ValueError("a peer server needs max_clients >= 1, timeout_s > 0 and "
                             "preauth_s > 0")
        secret = key if secret is None else secret
        if not secret:
            raise ValueError("a peer server needs the run's secret (a signing key or a "
                             "per-run key)")
        self.memory_dir = Path(memory_dir)
        self.run = run
        self.key = key
        self.secret = secret
        self.preauth_s = preauth_s
        self.timeout_s = timeout_s
        self.max_clients = max_clients
        self._bind_to = (host, port)
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._slots = threading.BoundedSemaphore(max_clients)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending: dict[str, int] = {}  # per address: connections in their handshake

    @property
    def address(self) -> tuple[str, int]:
        """The bound host and port (bound on first use, so a port 0 becomes the real one)."""
        host, port = self._bind().getsockname()[:2]
        return host, port

    def start(self) -> None:
        """Accept connections in a daemon thread."""
        if self._thread is not None:
            return
        listener = self._bind()
        self._thread = threading.Thread(target=self._accept_loop, args=(listener,),
                                        name="rtrain-peer-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close the listening socket and the connections being served."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1)  # then no connection is added
        with self._lock:
            listener, self._listener = self._listener, None
            conns = list(self._conns)
        if listener is not None:
            listener.close()
        for conn in conns:  # their threads see the connection end and give their slot back
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _bind(self) -> socket.socket:
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the peer server is closed")
            if self._listener is None:
                host = self._bind_to[0]
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                # "::" serves IPv4 too where it can: its published address may be either.
                dual = host == "::" and socket.has_dualstack_ipv6()
                self._listener = socket.create_server(self._bind_to, family=family,
                                                      backlog=max(16, 2 * self.max_clients),
                                                      dualstack_ipv6=dual)
                self._listener.settimeout(_ACCEPT_POLL_S)
            return self._listener

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if self._stop.is_set():
                    return
                log.warning("peer server: accept failed (%s)", e.strerror or e)
                self._stop.wait(_ACCEPT_POLL_S)  # e.g. out of file descriptors: not a spin
                continue
            who = f"peer {peer[0]}:{peer[1]}"
            if not self._admit(peer[0]):
                conn.close()  # unanswered: an address with its handshakes under way already
                continue
            no_delay(conn)
            with self._lock:
                self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn, peer[0], who), daemon=True,
                                 name="rtrain-peer-client").start()
            except RuntimeError as e:  # no thread to be had: this client is not served
                log.warning("peer server: cannot serve %s (%s)", who, e)
                with self._lock:
                    self._conns.discard(conn)
                conn.close()
                self._admitted(peer[0])

    def _admit(self, addr: str) -> bool:
        """Whether a connection from `addr` may start a handshake now (and count it)."""
        with self._lock:
            if self._pending.get(addr, 0) >= PREAUTH_PER_ADDRESS \
                    or sum(self._pending.values()) >= PREAUTH_MAX:
                return False
            self._pending[addr] = self._pending.get(addr, 0) + 1
            return True

    def _admitted(self, addr: str) -> None:
        """`addr`'s handshake is over, either way."""
        with self._lock:
            left = self._pending.get(addr, 0) - 1
            if left > 0:
                self._pending[addr] = left
            else:
                self._pending.pop(addr, None)

    def _serve(self, conn: socket.socket, addr: str, who: str) -> None:
        slot = False
        try:
            wire = Wire(conn, self.preauth_s, who)
            try:
                session = self._handshake(wire)
                if session is None:
                    return
                slot = self._slots.acquire(blocking=False)
                if not slot:
                    wire.send_line({"ok": False, "busy": True, "error":
                                    f"busy: serving {self.max_clients} clients already"})
                    return
                wire.send_line({"ok": True, "proof": peerwire.proof(session, "server")})
                wire.seal(session, sending=peerwire.TO_CLIENT, receiving=peerwire.TO_SERVER)
            finally:
                self._admitted(addr)
            wire.timeout_s = self.timeout_s
            _Session(self, wire).run()
        except PeerError as e:
            log.info("peer server: %s", e)
        except OSError as e:  # the memory dir, not the wire (Wire raises PeerError)
            log.warning("peer server: %s: %s", who, e.strerror or e)
        except Exception:  # a bug: said with its traceback, the server goes on serving others
            log.exception("peer server: serving %s failed", who)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if slot:
                self._slots.release()

    def _handshake(self, wire: Wire) -> bytes | None:
        """The connection's session key once the client proved it derived it (it holds the
        run's secret and answered this connection's nonces); None when refused (it was told
        why)."""
        nonce = peerwire.new_nonce()
        wire.send_line({"rtrain_peer": peerwire.PROTOCOL, "run": self.run, "nonce": nonce})
        hello = wire.read_line(REQUEST_LIMIT, "the handshake")
        assert hello is not None
        error = session = None
        if hello.get("run") != self.run:
            error = (f"another run: this node serves run {_short(self.run)}, the client is of "
                     f"run {_short(hello.get('run'))}")
        elif not peerwire.valid_nonce(hello.get("nonce")):
            error = "the handshake has no nonce (32 hex digits)"
        else:
            session = peerwire.session_key(self.secret, self.run, nonce, hello["nonce"])
            if not peerwire.proof_ok(session, "client", hello.get("proof")):
                error = ("bad or missing proof: the client does not hold this run's secret "
                         "(RTRAIN_SIGNING_KEY, or the run's peer key)")
        if error is not None:
            log.info("peer server: refused %s: %s", wire.who, error)
            wire.send_line({"ok": False, "error": error})
            return None
        return session

class _Session:
    """One authenticated client's requests, until it closes the connection."""

    def __init__(self, server: PeerServer, wire: Wire) -> None:
        self.server = server
        self.wire = wire
        self._found: dict[tuple[int, int, str], parts.Part] = {}

    def run(self) -> None:
        while (req := self.wire.read_line(REQUEST_LIMIT, "a request", eof_ok=True)) is not None:
            op = req.get("op")
            if op == "list":
                self._list()
            elif op == "get":
                self._get(req)
            else:
                self.wire.send_line({"error": f"unknown op {peerwire.one_line(op, 40)!r}"})

    def _listed(self, origins: tuple[str, ...] = (parts.OWN, parts.KEPT)) -> list[parts.Part]:
        """This run's parts; OSError when the memory dir cannot be listed (a file where a
        rank dir should be)."""
        s = self.server
        return [p for p in parts.list_parts(s.memory_dir, s.key, origins=origins)
                if p.run == s.run]

    def _list(self) -> None:
        try:
            found = self._listed()
        except OSError as e:
            self.wire.send_line({"error": f"cannot list the memory dir: {e.strerror or e}"})
            return
        listing = [{"rank": p.rank, "step": p.step, "world_size": p.world_size,
                    "origin": p.origin, "bytes": p.bytes, "manifest": p.manifest}
                   for p in found]
        data = json.dumps({"parts": listing}, separators=(",", ":")).encode() + b"\n"
        if len(data) > LIST_LIMIT:
            self.wire.send_line({"error": f"the listing is larger than {LIST_LIMIT >> 20} MiB"})
            return
        self.wire.send_frame(data)

    def _get(self, req: dict[str, Any]) -> None:
        rank, step, origin, name = (req.get(k) for k in ("rank", "step", "origin", "file"))
        if not (_count(rank) and _count(step) and origin in (parts.OWN, parts.KEPT)
                and isinstance(name, str)):
            self.wire.send_line({"error": "a get needs rank and step (counts), origin "
                                          f"{parts.OWN!r} or {parts.KEPT!r} and a file name"})
            return
        part = self._part(rank, step, origin)
        if isinstance(part, str):
            self.wire.send_line({"error": part})
            return
        if name != MANIFEST:
            try:
                check_name(name)
            except ManifestError as e:
                self.wire.send_line({"error": str(e)})
                return
            if name not in part.manifest["files"]:
                self.wire.send_line({"error": f"{peerwire.one_line(name, 200)!r} is not a "
                                              "file of that part"})
                return
        member = f"{part.path.relative_to(self.server.memory_dir).as_posix()}/{name}"
        try:
            f = safeio.open_beneath(self.server.memory_dir, member, buffering=0)
        except (OSError, ValueError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.wire.send_line({"error": f"{name}: {reason}"})
            return
        with f:
            self._send_file(f, name)

    def _send_file(self, f: BinaryIO, name: str) -> None:
        size = os.fstat(f.fileno()).st_size
        self.wire.send_line({"size": size})
        buf = bytearray(min(CHUNK, max(1, size)))
        view = memoryview(buf)
        left = size
        while left:
            # Whole chunks of min(left, CHUNK): each is a frame, its tag read after its size.
            piece = view[:min(left, len(buf))]
            got = 0
            while got < piece.nbytes:
                n = f.readinto(piece[got:])
                if not n:
                    # It shrank since: the client cannot be given the bytes promised.
                    raise PeerError(f"{name} shrank while it was sent to {self.wire.who}")
                got += n
            self.wire.send_frame(piece)
            left -= piece.nbytes

    def _part(self, rank: int, step: int, origin: str) -> parts.Part | str:
        """The listed part asked for, or why there is none."""
        key = (rank, step, origin)
        if key not in self._found:
            try:
                listed = self._listed((origin,))
            except OSError as e:
                return f"cannot list the memory dir: {e.strerror or e}"
            found = [p for p in listed if p.rank == rank and p.step == step]
            if not found:
                return self._why_not(rank, step, origin)
            self._found[key] = found[0]
        return self._found[key]

    def _why_not(self, rank: int, step: int, origin: str) -> str:
        s = self.server
        path = parts.rank_dir(s.memory_dir, rank, held=origin == parts.KEPT) / \
            checkpoint_name(step)
        what = f"no part of rank {rank} at step {step} ({origin})"
        v = verify(path, Level.QUICK, s.key)
        if v.status is Status.CORRUPT:
            return f"{what} here that verifies: {v.reason}"
        if v.ok:
            return f"{what} of this run here (run {_short(v.manifest and v.manifest.get('run'))})"
        return what


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _short(run: Any) -> str:
    return run[:8] if isinstance(run, str) and run else "none"
