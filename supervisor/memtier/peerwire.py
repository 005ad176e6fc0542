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

The handshake proves, when the run has a signing key, that each end holds it without sending
it: each side sends a fresh nonce, and each answers the other's nonce with
HMAC-SHA256(key, side + "|" + nonce + "|" + run), `side` "client" or "server" so that one
answer cannot be replayed as the other. Without a key the run identity is all that is checked:
it keeps runs apart by accident, it is no secret, so the port serves the run's parts to any host
that reaches it: bind it to the cluster's network (RTRAIN_PEER_HOST) and sign the run where that
network is shared. The transport is not encrypted: an encrypted run's parts travel encrypted.
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

from rtrain.checkpoint import safeio

PROTOCOL = 1
CHUNK = 1 << 20
REQUEST_LIMIT = 64 << 10
"""Largest line of a handshake or request, and of a reply other than a listing."""
LIST_LIMIT = 64 << 20
"""Largest listing: manifests of every part in a memory dir; a real one is kilobytes each."""
_NONCE = re.compile(r"[0-9a-f]{32}")


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


def mac(key: bytes | None, side: str, nonce: str, run: str | None) -> str | None:
    """`side`'s answer to the other end's `nonce`; None without a key."""
    if key is None:
        return None
    msg = side.encode() + b"|" + nonce.encode() + b"|" + (run or "").encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def mac_ok(key: bytes | None, side: str, nonce: str, run: str | None, given: Any) -> bool:
    """Whether `given` is `side`'s answer to `nonce` (always, without a key)."""
    expected = mac(key, side, nonce, run)
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


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

    def send_line(self, obj: dict[str, Any]) -> None:
        self.send(json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n")

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
