"""An attempt's log file (stdout.log, stderr.log): bounded, and best effort on a failing disk.

Bounded: a chatty child can write hundreds of MB a second. Past `cap_bytes` the file keeps its
head (the first half of the cap: start-up, settings, the first steps) and its tail (the newest
output, where a failure's traceback is), with one marker line between them that says how much
was cut there. The tail is kept between a quarter and a half of the cap: when it outgrows the
half, its oldest part is cut (read the newest quarter, truncate to the marker, write it back),
so each byte is rewritten at most once more.

Best effort: a full disk (ENOSPC, EDQUOT) or a failing one (EIO) must not stop training or
supervision. What cannot be written is counted and skipped; the next write that succeeds is
preceded by a line saying how many bytes are missing there and why. A log whose directory or
file cannot even be created (no free inode or block) is created at the first write that can.

Owned: the file is created with the run's file mode (owner-only by default, whatever the run
dir's own mode) through `ownfiles.open_own`, which refuses a link or a FIFO planted at its name
and a second name of another file: that output is not logged (a warning says why), and
nothing outside the run dir is ever written or cut.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE

log = logging.getLogger(__name__)

_LINE_SEARCH = 4096  # a cut starts at the next line start within this many bytes


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


class CappedLog:
    """Append-only log writer; `cap_bytes` None or 0: no cap. Never raises OSError on write."""

    def __init__(self, path: Path, cap_bytes: int | None, *,
                 mode: int = DEFAULT_FILE_MODE) -> None:
        self.path = Path(path)
        self.mode = mode
        self.fd = -1
        self.size = 0
        self.cap = cap_bytes or 0
        self.head_max = self.cap // 2
        self.tail_max = self.cap - self.head_max
        self.head_end: int | None = None  # where the head ends, once the cap was reached
        self.marker_len = 0  # the marker line right after the head
        self.cut_bytes = 0  # output left out by the cap
        self.lost_bytes = 0  # output not written for a storage error, since the last note
        self.lost_total = 0
        self._lost_reason = ""
        self.refused: str | None = None  # why the file at the name is not written, if it is not
        self.closed = False
        self._open()

    def _open(self) -> bool:
        if self.refused is not None:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            opened = ownfiles.open_own(self.path, os.O_RDWR | os.O_APPEND, create=True,
                                       mode=self.mode)
        except ownfiles.RefusedFile as e:
            self.refused = self._lost_reason = str(e)
            log.warning("output not logged: %s", e)
            return False
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            self._lost_reason = e.strerror or str(e)
            return False
        self.fd = opened.fd
        self.size = opened.st.st_size
        return True

    def write(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if self.fd < 0 and not self._open():
            self._lose(len(data), self._lost_reason)
            return
        if self.lost_bytes and not self._note_lost():
            self._lose(len(data), self._lost_reason)
            return
        if self.cap and self.head_end is None and self.size + len(data) > self.head_max:
            room = max(0, self.head_max - self.size)
            self._append(data[:room])
            self.head_end = self.size
            data = data[room:]
        self._append(data)
        if self.head_end is not None and self.size - self.head_end > self.tail_max:
            self._cut()

    def _append(self, data: bytes) -> bool:
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.fd, view)
            except OSError as e:
                self._lose(len(view), e.strerror or str(e))
                return False
            self.size += n
            view = view[n:]
        return True

    def _lose(self, n: int, why: str) -> None:
        if not self.lost_total and self.refused is None:  # a refusal was told already
            log.warning("cannot write %s (%s): output is dropped until there is room; "
                        "training goes on", self.path, why)
        self.lost_bytes += n
        self.lost_total += n
        self._lost_reason = why

    def _note_lost(self) -> bool:
        note = (f"\n[rtrain: {self.lost_bytes} bytes of output could not be logged here "
                f"({self._lost_reason})]\n").encode()
        lost, self.lost_bytes = self.lost_bytes, 0
        if self._append(note):
            return True
        self.lost_bytes = lost  # not the note's own bytes, which _append counted
        return False

    def _cut(self) -> None:
        """Drop the oldest part of the tail, keeping its newest quarter of the cap."""
        assert self.head_end is not None
        start = self.head_end + self.marker_len
        keep = self.tail_max // 2
        try:
            newest = os.pread(self.fd, keep, max(start, self.size - keep))
            line = newest.find(b"\n", 0, _LINE_SEARCH)
            if 0 <= line < len(newest) - 1:
                newest = newest[line + 1:]  # start the kept tail at a line start
            self.cut_bytes += self.size - start - len(newest)
            marker = (f"\n[rtrain: {self.cut_bytes} bytes of output cut here: this log keeps "
                      f"its first {_mib(self.head_max)} and its newest output]\n"
                      ).encode()
            os.ftruncate(self.fd, self.head_end)
        except OSError as e:
            self._lose(0, e.strerror or str(e))
            return
        self.size = self.head_end
        self.marker_len = 0
        if self._append(marker):
            self.marker_len = len(marker)
            self._append(newest)

    def close(self) -> None:
        if not self.closed:
            if self.fd < 0 and self.lost_bytes:
                self._open()
            if self.fd >= 0:
                if self.lost_bytes:
                    self._note_lost()
                os.close(self.fd)
            self.closed = True
