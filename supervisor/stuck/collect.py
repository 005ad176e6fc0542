"""The process side of the stuck-rank report: read what each rank left in the attempt dir at a
hang (its progress board, worker/stuck/progress.py; its stack dumps, proc/stacks.py) and hand it to
the rule (stuck/decide.py).

Ranks are matched to their stack files by pid (the board and the heartbeats carry both). A rank
without a board (a worker that could not make one) falls back on its last step heartbeat, which
the throttle may have left a step or more behind. Source lines are read only for the user's
frames, from regular files of bounded size, for the sentence.
"""

from __future__ import annotations

import logging
import sysconfig
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import rtrain
import rtrain.checkpoint
import rtrain.supervisor
import rtrain.worker
from rtrain.checkpoint import safeio
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.progress_board import SIZE, Progress, unpack
from rtrain.supervisor.stuck.decide import Frame, RankState, StuckReport, is_library, parse_stacks
from rtrain.supervisor.stuck.decide import summarise as summarise_states

log = logging.getLogger(__name__)

STACKS_MAX = 4 << 20  # bytes of one stack file read: a dump of many threads is a few KiB each
SOURCE_MAX = 4 << 20  # a source file larger than this is not read for its line


def library_roots() -> tuple[str, ...]:
    """The standard library and rtrain's own packages: frames there are not the user's."""
    paths = sysconfig.get_paths()
    # One folder in a wheel; four in an editable install, where the packages stay where they are.
    ours = (str(Path(package.__file__).resolve().parent)
            for package in (rtrain, rtrain.supervisor, rtrain.worker, rtrain.checkpoint))
    roots = {paths["stdlib"], paths["platstdlib"], *ours}
    return tuple(sorted(r for r in roots if r))


def read_boards(attempt_dir: Path) -> list[Progress]:
    """Every rank's progress board in the attempt dir; unreadable ones are skipped."""
    boards = []
    for path in sorted(attempt_dir.glob("progress-rank*.bin")):
        for _ in range(3):  # mid-write: read again
            try:
                board = unpack(ownfiles.read_own(path, limit=SIZE * 4, what="progress board"))
            except OSError as e:
                log.warning("progress board not read: %s", e)
                break
            if board is not None:
                boards.append(board)
                break
    return boards


def read_stack(attempt_dir: Path, pid: int) -> tuple[Frame, ...]:
    """The main thread of `pid`'s newest dump: faulthandler's when it has one (full paths),
    else py-spy's (paths shortened: no source lines, the user's code not told apart)."""
    for name in (f"stacks-{pid}.txt", f"stacks-pyspy-{pid}.txt"):
        try:
            text = ownfiles.read_own(attempt_dir / name, limit=STACKS_MAX, what="stack dump")
        except OSError:
            continue
        frames = parse_stacks(text.decode(errors="replace"))
        if frames:
            return frames
    return ()


def with_sources(frames: tuple[Frame, ...], roots: tuple[str, ...]) -> tuple[Frame, ...]:
    """The frames, the user's with their source line."""
    return tuple(f if is_library(f.file, roots) else replace(f, source=source_line(f))
                 for f in frames)


def source_line(frame: Frame) -> str:
    # The name comes from a stack dump in the attempt dir: a FIFO or device named there is
    # refused unopened. A link is followed: the user's script may be one.
    try:
        raw = safeio.read_limited(frame.file, SOURCE_MAX, follow_symlinks=True)
    except OSError:
        return ""
    lines = raw.decode("utf-8", errors="replace").splitlines()
    return lines[frame.line - 1].strip()[:200] if 0 < frame.line <= len(lines) else ""


def report(attempt_dir: Path, heard: Mapping[int, tuple[int, int | None]], *, now: float,
           world: int | None) -> StuckReport | None:
    """The stuck-rank report of a hung attempt. `heard`: rank -> (pid, last step) from its
    heartbeats; `now`: the unix time the hang was found."""
    roots = library_roots()
    states: dict[int, RankState] = {}
    for board in read_boards(attempt_dir):
        states[board.rank] = RankState(
            rank=board.rank, step=board.step, left_at=board.left_at,
            entered_at=board.entered_at,
            frames=with_sources(read_stack(attempt_dir, board.pid), roots))
    for rank, (pid, step) in heard.items():
        if rank not in states:
            states[rank] = RankState(rank=rank, step=step,
                                     frames=with_sources(read_stack(attempt_dir, pid), roots))
    return summarise_states(list(states.values()), now=now, world=world, library_roots=roots)
