"""The process side of the stuck-rank report: the worker's progress board (worker/stuck/progress.py)
read back by the supervisor, stack files matched to ranks by pid, source lines read, the
heartbeats as the fallback for a rank without a board."""

from __future__ import annotations

import os

from rtrain.checkpoint import commit
from rtrain.supervisor.core.progress_board import SIZE, board_name, pack, unpack
from rtrain.supervisor.stuck import collect
from rtrain.supervisor.stuck.collect import library_roots, read_boards, report
from rtrain.supervisor.stuck.decide import is_library
from rtrain.worker.stuck import progress
from rtrain.worker.stuck.progress import Board


def test_board_round_trip(tmp_path):
    b = Board(tmp_path, rank=2)
    assert read_boards(tmp_path)[0].step is None
    b.left(41)
    (p,) = read_boards(tmp_path)
    assert (p.rank, p.pid, p.step, p.entered_at) == (2, os.getpid(), 41, None)
    b.entered()
    (p,) = read_boards(tmp_path)
    assert p.left_at is not None and p.entered_at is not None and p.entered_at >= p.left_at
    assert (tmp_path / board_name(2)).stat().st_size == SIZE


def test_board_mid_write_or_foreign_is_not_read():
    assert unpack(pack(0, 1, 3, 5, 1.0, 2.0)) is None  # odd sequence: a write under way
    assert unpack(b"RTPX" + pack(0, 1, 2, 5, 1.0, 2.0)[4:]) is None
    assert unpack(b"short") is None
    assert unpack(pack(0, 1, 2, 5, 1.0, None)).entered_at is None


def _stack(tmp_path, pid, *frames):
    lines = ["Current thread 0x00007f0000000001 (most recent call first):"]
    lines += [f'  File "{f}", line {n} in {fn}' for f, n, fn in frames]
    (tmp_path / f"stacks-{pid}.txt").write_text("\n".join(lines) + "\n")


def test_report_from_boards_stacks_and_heartbeats(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("\n".join(f"line {n}" for n in range(1, 20)) + "\n"
                      "    out = model(x)  # the forward\n"
                      "    loss.backward()\n")
    attempt = tmp_path / "attempts" / "0"
    attempt.mkdir(parents=True)
    # rank 0 through its board (this process's pid), rank 1 only through its heartbeats
    board = Board(attempt, rank=0)
    board.left(7)
    board.entered()
    _stack(attempt, os.getpid(), (str(script), 20, "<module>"))
    _stack(attempt, 4242, ("/x/site-packages/torch/autograd/graph.py", 979, "backward"),
           (str(script), 21, "<module>"))
    rep = report(attempt, {0: (os.getpid(), 6), 1: (4242, 7)}, now=board.entered_at + 3,
                 world=2)
    assert rep is not None and rep.behind == (0,), rep.summary
    assert rep.summary.startswith("rank 0 is in step 8 (for 3 s) at `out = model(x)  # the "
                                  "forward` in <module> (train.py:20)"), rep.summary
    assert "rank 1 waits" in rep.summary and "`loss.backward()`" in rep.summary
    # without a stack or a board for a rank heard of, it still appears, with its step
    rep = report(attempt, {5: (999, 3)}, now=0.0, world=None)
    assert rep is not None and {p.rank: p.step for p in rep.ranks}[5] == 3


def test_no_report_without_ranks(tmp_path):
    assert report(tmp_path, {}, now=0.0, world=None) is None


def test_a_frame_in_any_of_rtrains_packages_is_the_librarys():
    """An editable install leaves each package in its own folder: a frame in the format, the
    worker or the supervisor is rtrain's, never the script's line."""
    roots = library_roots()
    assert all(is_library(m.__file__, roots) for m in (commit, collect, progress, os))
    assert not is_library(__file__, roots)
