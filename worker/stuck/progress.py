"""This rank's progress board (supervisor/core/progress_board.py): the last step boundary and
when the rank left that step and began the next, stored into a mapped file of the attempt dir
so that rtrain can say which rank is stuck at a hang.

`runtime.heartbeat` marks a step's end (`left`) on every step heartbeat, before its throttle;
`Checkpointer.maybe_save` marks the next step's start (`entered`) as it returns. Each mark is
a few stores into memory. Without a supervisor, or when the file cannot be made, nothing is
kept and the marks do nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from pathlib import Path

from rtrain.supervisor.core import filemode, ownfiles
from rtrain.supervisor.core.progress_board import SIZE, board_name, pack, seq_offset

log = logging.getLogger(__name__)


class Board:
    """The mapped board of one process."""

    def __init__(self, status_dir: Path, rank: int) -> None:
        self.rank, self.pid = rank, os.getpid()
        self.seq = 0
        self.step: int | None = None
        self.left_at: float | None = None
        self.entered_at: float | None = None
        opened = ownfiles.open_own(status_dir / board_name(rank), os.O_RDWR, create=True,
                                   mode=filemode.env_mode(os.environ))
        try:
            os.ftruncate(opened.fd, SIZE)
            self.map = mmap.mmap(opened.fd, SIZE)
        finally:
            os.close(opened.fd)
        self._write()

    def left(self, step: int) -> None:
        self.step, self.left_at, self.entered_at = step, time.time(), None
        self._write()

    def entered(self) -> None:
        self.entered_at = time.time()
        self._write()

    def _write(self) -> None:
        # Odd while writing: a reader that sees it, or sees it change, reads again.
        self.seq += 1
        struct.pack_into("<I", self.map, seq_offset(), self.seq)
        self.seq += 1
        self.map[:SIZE] = pack(self.rank, self.pid, self.seq, self.step, self.left_at,
                               self.entered_at)


_board: Board | None = None


def open_board(status_dir: Path, rank: int) -> None:
    """Make this process's board (once); training goes on without one if it cannot be made."""
    global _board
    if _board is not None and _board.pid == os.getpid():
        return
    try:
        _board = Board(status_dir, rank)
    except (OSError, ValueError) as e:
        log.warning("no progress board for the hang report: %s", e)
        _board = None


def left(step: int) -> None:
    if _board is not None:
        _board.left(step)


def entered() -> None:
    if _board is not None:
        _board.entered()

