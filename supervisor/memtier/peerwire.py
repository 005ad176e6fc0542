"""The wire of the memory tier's peer copies: framing, bounds, the handshake's MACs, the errors.

Both ends (`peerserver.py`, `peerfetch.py`) speak through a `Wire`: JSON objects one per line,
and raw file bytes after a `{"size": N}` line. Every read has a deadline, so neither end can be
held by a peer that stops sending or trickles:

- a line must arrive whole within `timeout_s`, and is refused once longer than its limit
  (`REQUEST_LIMIT` for requests and the handshake, `LIST_LIMIT` for a listing) before more of
  it is read;
- file bytes come in chunks of at most `CHUNK`, each within `timeout_s` (at the default 10 s a
  peer slower than 100 KiB/s is given up on); a send of a chunk or a line has the same limit.

So at most one chunk (plus one line) is held in memory per connection.

The handshake binds the connection to the run's secret (`secret`: the signing key, or without
one the per-run key rtrain keeps owner-only in the registry dir, registry.py) without sending
it. Each side sends a fresh nonce; both derive the connection's session key

    session = HMAC-SHA256(secret, "rtrain peer session 2|" + run + "|" + server nonce + "|"
                                  + client nonce)

and each proves it holds it (`proof`: HMAC of the session key and its side, "client" or
"server", so one answer cannot be replayed as the other). From then on every frame (a JSON
line, a listing, a chunk of a file) is followed by its 32-byte tag: BLAKE3 keyed with the
session key over the direction, the frame's sequence number in that direction and the frame.
A party that passes the handshake through between a real node and its server learns no key,
so it can neither send a request of its own nor change, drop, reorder or replay a frame of
either side unnoticed. The transport is not encrypted: an on-path party sees what a node asks
for and receives (an encrypted run's parts travel encrypted).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import socket
import time
from typing import Any

import blake3

from rtrain.checkpoint import safeio

PROTOCOL = 2
CHUNK = 1 << 20
TAG = 32
"""Bytes of the tag after each frame once the handshake is done."""
REQUEST_LIMIT = 64 << 10
"""Largest line of a handshake or request, and of a reply other than a listing."""
LIST_LIMIT = 64 << 20
"""Largest listing: manifests of every part in a memory dir; a real one is kilobytes each."""
_NONCE = re.compile(r"[0-9a-f]{32}")
_SESSION = b"rtrain peer session 2|"
TO_SERVER, TO_CLIENT = b"c>s", b"s>c"
"""The directions a tag names: a client's frame can never pass as the server's."""


class PeerError(Exception):
    """A peer copy that did not happen; str() is the one-line reason a person reads."""


class PeerUnreachable(PeerError):
    """No answer: cannot connect, timed out, or the connection closed mid-transfer. Worth
    trying again later or from another peer."""


class PeerBusy(PeerUnreachable):
    """The peer serves as many clients as it allows: try again shortly."""


class PeerRefused(PeerError):
    """The peer or its data is refused (another run, a bad MAC, a file whose size or hash does
    not match the manifest, a bad signature, a part that is not the one asked for), or the peer
    refused us. Trying again gets the same answer until something changes."""


class NoRoom(PeerRefused):
    """This node cannot take the part: not enough free space, or writing it failed."""


def new_nonce() -> str:
    return os.urandom(16).hex()


def valid_nonce(value: Any) -> bool:
    return isinstance(value, str) and _NONCE.fullmatch(value) is not None


def session_key(secret: bytes, run: str | None, server_nonce: str, client_nonce: str
                ) -> bytes:
    """The connection's key: bound to the run, both nonces and the run's secret."""
    msg = _SESSION + "|".join((run or "", server_nonce, client_nonce)).encode()
    return hmac.new(secret, msg, hashlib.sha256).digest()


def proof(session: bytes, side: str) -> str:
    """`side`'s proof ("client" or "server") that it derived `session`."""
    return hmac.new(session, b"proof|" + side.encode(), hashlib.sha256).hexdigest()


def proof_ok(session: bytes, side: str, given: Any) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(),
                                                          proof(session, side).encode())


def one_line(text: Any, limit: int = 300) -> str:
    """A peer's message as it may be shown: one line, bounded (it is data from the network)."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


class Wire:
    """One connection's framing. Transport failures raise PeerUnreachable, a malformed or
    oversized line PeerRefused; `who` names the other end in the messages."""

    def __init__(self, sock: socket.socket, timeout_s: float, who: str) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.who = who
        self._buf = bytearray()
        self._key: bytes | None = None  # the session key, once the handshake is done
        self._out = self._in = b""
        self._sent = self._received = 0

    def seal(self, session: bytes, *, sending: bytes, receiving: bytes) -> None:
        """From now on every frame sent carries a tag and every frame read must (`TAG`)."""
        self._key, self._out, self._in = session, sending, receiving

    def _tag(self, direction: bytes, seq: int, data: bytes | memoryview) -> bytes:
        assert self._key is not None
        h = blake3.blake3(direction + seq.to_bytes(8, "big"), key=self._key)
        h.update(data)
        return h.digest()

    def send_line(self, obj: dict[str, Any]) -> None:
        self.send_frame(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
                        + b"\n")

    def send_frame(self, data: bytes | memoryview) -> None:
        """One frame (a line, or a chunk of a file), with its tag once sealed."""
        if self._key is None:
            self.send(data)
            return
        tag = self._tag(self._out, self._sent, data)
        self._sent += 1
        self.send(data)
        self.send(tag)

    def send(self, data: bytes | memoryview) -> None:
        # sendall's timeout bounds the whole call, not each partial send.
        self.sock.settimeout(self.timeout_s)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise PeerUnreachable(f"{self.who} took nothing for {self.timeout_s:g} s "
                                  "(timed out)") from None
        except OSError as e:
            raise PeerUnreachable(f"connection to {self.who} lost: {e.strerror or e}") from None

    def read_line(self, limit: int, what: str, *, eof_ok: bool = False
                  ) -> dict[str, Any] | None:
        """The next line as a JSON object. None at a clean end of the connection when
        `eof_ok` (between requests)."""
        deadline = time.monotonic() + self.timeout_s
        scanned = 0
        while (end := self._buf.find(b"\n", scanned)) < 0:
            if len(self._buf) > limit:
                raise PeerRefused(f"{what} from {self.who} is longer than {limit} bytes")
            scanned = len(self._buf)
            data = self._recv(min(CHUNK, limit + 1 - len(self._buf)), deadline, what)
            if not data:
                if eof_ok and not self._buf:
                    return None
                raise PeerUnreachable(f"{self.who} closed the connection before {what}")
            self._buf += data
        if end > limit:
            raise PeerRefused(f"{what} from {self.who} is longer than {limit} bytes")
        line = bytes(self._buf[:end])
        del self._buf[:end + 1]
        if self._key is not None:
            self._check(memoryview(line + b"\n"), deadline, what)
        try:
            obj = safeio.parse_json(line)
        except ValueError as e:
            raise PeerRefused(f"{what} from {self.who} {e}") from None
        if not isinstance(obj, dict):
            raise PeerRefused(f"{what} from {self.who} is not a JSON object")
        return obj

    def read_into(self, view: memoryview, what: str) -> None:
        """Fill `view` (at most a chunk) within `timeout_s`."""
        deadline = time.monotonic() + self.timeout_s
        got = min(len(self._buf), view.nbytes)
        view[:got] = self._buf[:got]
        del self._buf[:got]
        while got < view.nbytes:
            n = self._recv_into(view[got:], deadline, what)
            if not n:
                raise PeerUnreachable(f"{self.who} closed the connection in the middle of "
                                      f"{what}")
            got += n
        if self._key is not None:
            self._check(view, deadline, what)

    def _check(self, frame: memoryview, deadline: float, what: str) -> None:
        """Read the frame's tag and check it: a frame nobody with the session key sent (a
        relay's own, one changed on the way, replayed or reordered) ends the connection."""
        tag = bytearray(TAG)
        got = min(len(self._buf), TAG)
        tag[:got] = self._buf[:got]
        del self._buf[:got]
        while got < TAG:
            n = self._recv_into(memoryview(tag)[got:], deadline, what)
            if not n:
                raise PeerUnreachable(f"{self.who} closed the connection in the middle of "
                                      f"{what}")
            got += n
        expected = self._tag(self._in, self._received, frame)
        self._received += 1
        if not hmac.compare_digest(bytes(tag), expected):
            raise PeerRefused(f"{what} from {self.who} is not authenticated: not sent by the "
                              "node that did the handshake (relayed, or changed on the way)")

    def _recv(self, n: int, deadline: float, what: str) -> bytes:
        buf = bytearray(n)
        got = self._recv_into(memoryview(buf), deadline, what)
        return bytes(buf[:got])

    def _recv_into(self, view: memoryview, deadline: float, what: str) -> int:
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out(what)
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(view)
        except TimeoutError:
            raise self._timed_out(what) from None
        except OSError as e:
            raise PeerUnreachable(f"connection to {self.who} lost during {what}: "
                                  f"{e.strerror or e}") from None

    def _timed_out(self, what: str) -> PeerUnreachable:
        return PeerUnreachable(f"{self.who} stopped sending {what} ({self.timeout_s:g} s "
                               "without progress: timed out)")


def no_delay(sock: socket.socket) -> None:
    """Requests and replies are short lines, one waiting for the other: without TCP_NODELAY
    each would wait out the peer's delayed ACK (tens of ms), and a copy makes several."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
