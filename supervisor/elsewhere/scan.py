"""Why there is nothing to resume from (elsewhere/decide.py holds the rule): the look at the
checkpoint dir, the bounded scan of the script's working dir, and `ElsewhereWatch`, which the
loop feeds with the attempts' starts and ends, and which records the notice once: when a
fresh attempt follows a failed one (a run that finishes, gives up or stops needs no notice).

The scan: breadth first from the working dir, at most `MAX_DEPTH` levels and `MAX_ENTRIES`
directory entries, never into hidden dirs, `__pycache__`/`node_modules`/`site-packages`,
symbolic links, the run dir or the watched dir; only entries modified since the launch's first
attempt started. It runs only before a fresh relaunch after a failed attempt, while the notice
has not been given, and only for a run that hands the script its checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

from rtrain.checkpoint.layout import parse_step
from rtrain.supervisor.ckpt.foreign import list_candidates
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.elsewhere.decide import CannotResume, Seen, Written, judge, short
from rtrain.supervisor.records.events import EventLog

SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")
NOT_CHECKPOINTS = {"training_args.bin"}  # a Trainer writes it beside its checkpoints
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
MAX_DEPTH = 4
MAX_ENTRIES = 5000


def scan(root: Path, *, since: float, skip: Collection[Path] = (), max_depth: int = MAX_DEPTH,
         max_entries: int = MAX_ENTRIES) -> tuple[Written, ...]:
    """Checkpoint-like entries under `root` modified at or after `since` (unix time): files
    named `*.pt`, `*.pth`, `*.ckpt`, `*.bin`, `*.safetensors`, and `checkpoint-N` dirs (not
    entered). Bounded as the module docstring says; unreadable dirs are passed over."""
    skip_ids = set()
    for p in skip:
        try:
            st = os.stat(p)
        except OSError:
            continue
        skip_ids.add((st.st_dev, st.st_ino))
    found: list[Written] = []
    seen_entries = 0
    queue: deque[tuple[str, str, int]] = deque([(str(root), "", 0)])
    while queue and seen_entries < max_entries:
        path, rel, depth = queue.popleft()
        try:
            entries = os.scandir(path)
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen_entries += 1
                if seen_entries > max_entries:
                    break
                name = entry.name
                if name.startswith("."):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                where = f"{rel}{name}"
                if stat.S_ISDIR(st.st_mode):
                    if name in SKIP_DIRS or (st.st_dev, st.st_ino) in skip_ids:
                        continue
                    if parse_step(name) is not None:
                        if st.st_mtime >= since:
                            found.append(Written(path=where + "/", mtime=st.st_mtime,
                                                 is_dir=True))
                    elif depth + 1 < max_depth:
                        queue.append((entry.path, where + "/", depth + 1))
                elif (stat.S_ISREG(st.st_mode) and name.endswith(SUFFIXES)
                      and name not in NOT_CHECKPOINTS and st.st_mtime >= since):
                    found.append(Written(path=where, mtime=st.st_mtime))
    return tuple(found)


def shown_path(path: Path, cwd: Path) -> str:
    """`path` as a person would type it from the script's working dir."""
    try:
        rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(cwd))
    except ValueError:
        return str(path)
    return f"./{rel.as_posix()}" if str(rel) != "." else "."


def present(ckpt_dir: Path, *, skip: Collection[Path] = (),
            max_entries: int = MAX_ENTRIES) -> tuple[str, ...]:
    """What the checkpoint dir holds, sorted (a dir's name ends in '/'): for the notice when
    none of it is a checkpoint. Hidden names (rtrain's own `.rtrain-*` among them) and `skip`
    (the run dir, when it lies inside) are left out; at most `max_entries` are read."""
    skip_ids = set()
    for p in skip:
        with contextlib.suppress(OSError):
            st = os.stat(p)
            skip_ids.add((st.st_dev, st.st_ino))
    names = []
    try:
        entries = os.scandir(ckpt_dir)
    except OSError:
        return ()
    with entries:
        for n, entry in enumerate(entries):
            if n >= max_entries:
                break
            if entry.name.startswith("."):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in skip_ids:
                continue
            names.append(entry.name + ("/" if stat.S_ISDIR(st.st_mode) else ""))
    return tuple(sorted(names))


class ElsewhereWatch:
    """One launch's look, before a fresh relaunch of a failed attempt, for why there is
    nothing to resume from (elsewhere/decide.py); says it at most once."""

    def __init__(self, *, hands: bool, cwd: Path, ckpt_dir: Path, run_dir: Path,
                 events: EventLog, say: Callable[[str], None]) -> None:
        self.hands = hands
        self.cwd, self.ckpt_dir, self.run_dir = cwd, ckpt_dir, run_dir
        self.events, self.say = events, say
        self.notice: CannotResume | None = None
        self._attempt: int | None = None
        self._ended: Observation | None = None  # the last attempt, when it failed
        self._since: float | None = None  # unix time the launch's first attempt started

    def attempt_started(self, attempt: int, *, fresh: bool) -> None:
        """Attempt `attempt` starts, `fresh` without a checkpoint: after a failed attempt of
        this launch, the moment to say why, the first time."""
        if fresh and self._ended is not None:
            self._judge(self._ended)
        self._attempt, self._ended = attempt, None
        if self._since is None:
            # Compared with file mtimes: the real clock, and a second's slack for filesystems
            # that keep coarse timestamps.
            self._since = time.time() - 1.0

    def attempt_ended(self, seen: Observation) -> None:
        self._ended = seen if seen.returncode != 0 else None

    def _judge(self, seen: Observation) -> None:
        if self.notice is not None or self._since is None:
            return
        if list_candidates(self.ckpt_dir, read_steps=False):
            return
        skip = (self.run_dir, self.ckpt_dir)
        written = scan(self.cwd, since=self._since, skip=skip) if self.hands else ()
        notice = judge(Seen(hands=self.hands, worker=seen.heartbeats.count > 0,
                            watched=shown_path(self.ckpt_dir, self.cwd), resumable=False,
                            present=present(self.ckpt_dir, skip=skip), written=written))
        if notice is None:
            return
        self.notice = notice
        self.events.emit(Kind.CANNOT_RESUME, attempt=self._attempt, reason=notice.reason.value,
                         ckpt_dir=str(self.ckpt_dir), files=list(notice.files),
                         suggest=notice.ckpt_dir, message=notice.message)
        self.say(f"warning: {notice.message}")

    def launch_note(self) -> str | None:
        """For a fresh launch line after the notice, while the watched dir is still empty."""
        if self.notice is None or list_candidates(self.ckpt_dir, read_steps=False):
            return None
        return short(self.notice)
