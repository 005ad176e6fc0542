"""Best-effort console output for `rtrain launch`: a write to the terminal never blocks.

The console is whatever the user put at our stdout/stderr: a terminal that may be paused
(Ctrl-S, a stopped pager), a pipe nobody reads (`| sleep 600`) or one closed early
(`| head -c 300`). A blocking write there would freeze the watch loop, and with it stop
signals, hang detection and the child itself (it blocks on its own full pipe). So while a
launch runs, `sys.stdout` and `sys.stderr` are replaced by streams whose writes:

- go out at once when the console takes them (non-blocking: pipes and terminals are reopened
  through /proc/self/fd with O_NONBLOCK on our own open file description, so the shell sharing
  the terminal is untouched; sockets use MSG_DONTWAIT);
- wait in a bounded buffer (`PENDING_MAX`) while it is slow, and are dropped beyond it, counted;
  once the console takes output again it first reads "[rtrain: N lines not echoed, see ...]";
- stop for good on EPIPE (the reader went away). SIGPIPE stays ignored (Python's default).

Everything the child writes is in the attempt's log files regardless; the console is a view.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import select
import socket
import stat
import sys
from collections.abc import Iterator

PENDING_MAX = 256 * 1024  # bytes held for a slow console before output is dropped
_POLL_CHUNK = 512  # without a non-blocking descriptor: at most this much per ready poll


class BestEffortWriter(io.RawIOBase):
    """A raw binary stream over `fd` whose `write` accepts everything and never blocks."""

    def __init__(self, fd: int, *, hint: str = "") -> None:
        super().__init__()
        self.fd = fd
        self.hint = hint  # where the dropped output can be read, e.g. "run/attempts/3/"
        self.pending = bytearray()
        self.dropped_lines = 0
        self.dropped_bytes = 0
        self.gone = False  # the reader went away (EPIPE): nothing is echoed any more
        self._isatty = os.isatty(fd)
        self._own_fd: int | None = None  # our non-blocking descriptor of the same file
        self._sock: socket.socket | None = None
        self._regular = False
        self._open()

    def _open(self) -> None:
        try:
            mode = os.fstat(self.fd).st_mode
        except OSError:
            self.gone = True
            return
        if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
            self._regular = True  # a file takes writes without waiting for a reader
        elif stat.S_ISSOCK(mode):
            self._sock = socket.socket(fileno=os.dup(self.fd))
        else:
            try:
                self._own_fd = os.open(f"/proc/self/fd/{self.fd}",
                                       os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError as e:
                if e.errno == errno.ENXIO:  # a FIFO whose reader is gone already
                    self.gone = True
                # else: no /proc, or refused: fall back to writing only when poll says ready

    # io.RawIOBase interface ------------------------------------------------------------

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._isatty

    def fileno(self) -> int:
        return self.fd

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        n = len(data)
        if self.gone or not n:
            return n
        self._flush_pending()
        if self.pending or self.dropped_lines or self.dropped_bytes:
            self._hold(bytes(data))
            self._flush_pending()
            return n
        sent = self._send(bytes(data))
        if sent < n and not self.gone:
            self._hold(bytes(data[sent:]))
        return n

    def close(self) -> None:
        if not self.closed:
            self._flush_pending()
            if self._own_fd is not None:
                os.close(self._own_fd)
                self._own_fd = None
            if self._sock is not None:
                self._sock.close()  # our duplicate of the descriptor
                self._sock = None
        super().close()

    # ------------------------------------------------------------------------------------

    def try_flush(self) -> None:
        """Send what waits, if the console takes it now (call now and then, e.g. per sample)."""
        if not self.gone:
            self._flush_pending()

    def _hold(self, data: bytes) -> None:
        # Once output is dropped, nothing newer is held until the note has gone out: the
        # console must never show later lines before the gap it was told about.
        if not self.dropped_bytes and len(data) <= PENDING_MAX - len(self.pending):
            self.pending += data
            return
        self.dropped_lines += data.count(b"\n") or 1
        self.dropped_bytes += len(data)

    def _flush_pending(self) -> None:
        if self.pending:
            sent = self._send(bytes(self.pending))
            del self.pending[:sent]
            if self.pending:
                return
        if self.dropped_lines or self.dropped_bytes:
            where = f", see {self.hint}" if self.hint else ""
            note = (f"\n[rtrain: {self.dropped_lines} lines not echoed (the console was "
                    f"too slow){where}]\n").encode()
            if self._send(note) == len(note):
                self.dropped_lines = self.dropped_bytes = 0
            # a part of the note went out: the rest is lost, the counts are kept for the next

    def _send(self, data: bytes) -> int:
        """Write what the console takes now; the number of bytes it took."""
        try:
            if self._regular:
                return os.write(self.fd, data)
            if self._sock is not None:
                return self._sock.send(data, socket.MSG_DONTWAIT)
            if self._own_fd is not None:
                return os.write(self._own_fd, data)
            ready = select.select([], [self.fd], [], 0)[1]
            return os.write(self.fd, data[:_POLL_CHUNK]) if ready else 0
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as e:
            if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENXIO):
                self.gone = True  # nobody reads any more: stop echoing, keep supervising
                self.pending.clear()
            return 0  # ENOSPC or EIO on a file: this piece is lost, the next may go out


def _stream(fd: int, old: io.TextIOBase) -> tuple[io.TextIOWrapper, BestEffortWriter]:
    raw = BestEffortWriter(fd)
    buffered = io.BufferedWriter(raw, buffer_size=8192)
    text = io.TextIOWrapper(buffered, encoding=getattr(old, "encoding", None) or "utf-8",
                            errors="backslashreplace", line_buffering=True)
    return text, raw


@contextlib.contextmanager
def best_effort_console() -> Iterator[list[BestEffortWriter]]:
    """Replace sys.stdout and sys.stderr by best-effort streams for the block; yields their
    raw writers (for `hint` and `try_flush`). Streams without a real descriptor (a test's
    capture) are left as they are."""
    swapped: list[tuple[str, object, io.TextIOWrapper]] = []
    writers: list[BestEffortWriter] = []
    for name in ("stdout", "stderr"):
        old = getattr(sys, name)
        try:
            fd = old.fileno()
            old.flush()
        except (AttributeError, ValueError, OSError):
            continue  # io.UnsupportedOperation is a ValueError and an OSError
        text, raw = _stream(fd, old)
        setattr(sys, name, text)
        swapped.append((name, old, text))
        writers.append(raw)
    try:
        yield writers
    finally:
        for name, old, text in reversed(swapped):
            with contextlib.suppress(Exception):  # best effort, like every write here
                text.flush()
            setattr(sys, name, old)
            text.detach().detach().close()  # closes our own descriptors, not fd 1 or 2
