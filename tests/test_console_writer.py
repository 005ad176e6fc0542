"""BestEffortWriter on real pipes: writes never block, a slow reader is told what it missed,
a reader that went away ends the echo without an error."""

from __future__ import annotations

import os
import time

from rtrain.supervisor.proc.console import PENDING_MAX, BestEffortWriter


def _drain(fd: int) -> bytes:
    os.set_blocking(fd, False)
    out = bytearray()
    try:
        while chunk := os.read(fd, 65536):
            out += chunk
    except BlockingIOError:
        pass
    return bytes(out)


def test_writes_to_a_pipe_nobody_reads_return_at_once(tmp_path):
    r, w = os.pipe()
    writer = BestEffortWriter(w, hint="run/attempts/0/")
    line = b"y" * 99 + b"\n"
    t0 = time.monotonic()
    for _ in range(20_000):  # 2 MB into a 64 KiB pipe
        assert writer.write(line) == len(line)
    # A write that blocked would wait forever on this pipe (pytest-timeout ends the test); the
    # bound only catches a write that waits a little each time, with room for a loaded machine.
    assert time.monotonic() - t0 < 30
    assert len(writer.pending) <= PENDING_MAX and writer.dropped_lines > 0
    got = _drain(r)
    while writer.pending:  # the reader is back
        writer.try_flush()
        got += _drain(r)
    writer.write(b"after\n")
    got += _drain(r)
    assert got.startswith(line) and got.endswith(b"\nafter\n")
    assert b"lines not echoed (the console was too slow), see run/attempts/0/]\n" in got
    lines = got.split(b"\n[rtrain: ")[0].split(b"\n")
    assert set(lines[:-1]) == {line[:-1]}  # nothing torn before the note
    writer.close()
    os.close(r)
    os.close(w)


def test_a_reader_that_went_away_ends_the_echo_quietly():
    r, w = os.pipe()
    writer = BestEffortWriter(w)
    os.close(r)
    assert writer.write(b"hello\n") == 6  # EPIPE: no exception, no SIGPIPE death
    assert writer.gone
    assert writer.write(b"more\n") == 5
    writer.close()
    os.close(w)


def test_a_regular_file_gets_everything(tmp_path):
    path = tmp_path / "out"
    with open(path, "wb") as f:
        writer = BestEffortWriter(f.fileno())
        for i in range(1000):
            writer.write(f"line {i}\n".encode())
        writer.close()
    assert path.read_bytes() == b"".join(f"line {i}\n".encode() for i in range(1000))
