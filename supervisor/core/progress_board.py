"""Where a rank is, kept in a small file of the attempt dir that the worker maps into memory:
`progress-rank<R>.bin`. Shared by both halves: the worker writes it at every step boundary, the
supervisor reads it when it finds the attempt hung (supervisor/stuck/collect.py).

Why a mapped file and not a heartbeat: step heartbeats are throttled (at most one every 0.2 s),
so the last one heard may be several steps old, and a rank that stops sends nothing more. A
store into mapped memory costs no system call, is never throttled, and can be read while the
process is stuck, stopped or dead.

Layout (little-endian, `FORMAT`): magic `RTPB`, version, rank, pid, a sequence number (odd
while a write is under way), the last step boundary reached (-1: none yet), the unix time the
rank reached it (`left_at`: it left that step) and the unix time it began the next one
(`entered_at`: the boundary returned; 0 until then). A reader retries while the sequence is odd
or changes under it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"RTPB"
VERSION = 1
FORMAT = "<4sIiiIqdd"
SIZE = struct.calcsize(FORMAT)
_SEQ_OFFSET = struct.calcsize("<4sIii")


def board_name(rank: int) -> str:
    return f"progress-rank{rank}.bin"


@dataclass(frozen=True)
class Progress:
    """One rank's board, as read."""

    rank: int
    pid: int
    step: int | None
    left_at: float | None
    entered_at: float | None


def pack(rank: int, pid: int, seq: int, step: int | None, left_at: float | None,
         entered_at: float | None) -> bytes:
    return struct.pack(FORMAT, MAGIC, VERSION, rank, pid, seq,
                       -1 if step is None else step, left_at or 0.0, entered_at or 0.0)


def unpack(data: bytes) -> Progress | None:
    """The board in `data`, or None when it is not one of this version or is mid-write."""
    if len(data) < SIZE:
        return None
    magic, version, rank, pid, seq, step, left, entered = struct.unpack_from(FORMAT, data)
    if magic != MAGIC or version != VERSION or seq % 2:
        return None
    return Progress(rank=rank, pid=pid, step=None if step < 0 else step,
                    left_at=left or None, entered_at=entered or None)


def seq_offset() -> int:
    """Where the sequence number sits: the writer bumps it around each update."""
    return _SEQ_OFFSET
