"""Checkpoints written where rtrain does not look (elsewhere/decide.py holds the rule): the
bounded scan of the script's working dir, and `ElsewhereWatch`, which the loop feeds with the
attempts' starts and ends and polls at each sample, and which records the warning once.

The scan is the only I/O: breadth first from the working dir, at most `MAX_DEPTH` levels and
`MAX_ENTRIES` directory entries, never into hidden dirs, `__pycache__`/`node_modules`/
`site-packages`, symbolic links, the run dir or the watched dir; only entries modified since
the launch's first attempt started. It runs only once the threshold is reached, then at most
every `SCAN_EVERY_S` until it finds something or the watched dir gets a checkpoint.
"""

from __future__ import annotations

import os
import stat
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

from rtrain.checkpoint.layout import parse_step
from rtrain.supervisor.ckpt.foreign import list_candidates
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.elsewhere.decide import Elsewhere, Seen, Written, judge, short
from rtrain.supervisor.records.events import EventLog

SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")
NOT_CHECKPOINTS = {"training_args.bin"}  # a Trainer writes it beside its checkpoints
SKIP_DIRS = {"__pycache__", "node_modules", "site-packages"}
MAX_DEPTH = 4
MAX_ENTRIES = 5000
SCAN_EVERY_S = 30.0


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


class ElsewhereWatch:
    """One launch's watch for checkpoints written elsewhere; warns at most once."""

    def __init__(self, *, after_s: float, expects: bool, cwd: Path, ckpt_dir: Path,
                 run_dir: Path, events: EventLog, say: Callable[[str], None],
                 monotonic: Callable[[], float]) -> None:
        self.after_s, self.expects = after_s, expects
        self.cwd, self.ckpt_dir, self.run_dir = cwd, ckpt_dir, run_dir
        self.events, self.say, self.monotonic = events, say, monotonic
        self.warning: Elsewhere | None = None
        self._off = after_s <= 0 or not expects
        self._attempt: int | None = None
        self._since: float | None = None  # unix time the launch's first attempt started
        self._trained = 0.0  # seconds run by the launch's attempts that ended
        self._t0: float | None = None
        self._last_scan = float("-inf")

    def attempt_started(self, attempt: int) -> None:
        self._attempt, self._t0 = attempt, self.monotonic()
        if self._since is None:
            # Compared with file mtimes: the real clock, and a second's slack for filesystems
            # that keep coarse timestamps.
            self._since = time.time() - 1.0

    def attempt_ended(self) -> None:
        self.poll(final=True)  # an attempt that wrote its checkpoint and died between samples
        if self._t0 is not None:
            self._trained += self.monotonic() - self._t0
            self._t0 = None

    def poll(self, *, final: bool = False) -> None:
        """At a sample: scan when due, and warn when the rule says so."""
        if self._off or self.warning is not None or self._t0 is None:
            return
        now = self.monotonic()
        trained = self._trained + (now - self._t0)
        if trained < self.after_s:
            return
        if not final and now - self._last_scan < min(SCAN_EVERY_S, self.after_s):
            return
        self._last_scan = now
        if list_candidates(self.ckpt_dir):
            self._off = True  # the dir has a checkpoint: resume works, nothing to watch
            return
        assert self._since is not None
        written = scan(self.cwd, since=self._since, skip=(self.run_dir, self.ckpt_dir))
        warning = judge(Seen(expects=self.expects, watched=shown_path(self.ckpt_dir, self.cwd),
                             watched_empty=True, trained_s=trained, written=written),
                        self.after_s)
        if warning is None:
            return
        self.warning = warning
        self.events.emit(Kind.CHECKPOINTS_ELSEWHERE, attempt=self._attempt,
                         ckpt_dir=str(self.ckpt_dir), files=list(warning.files),
                         suggest=warning.ckpt_dir, trained_s=round(warning.trained_s, 1),
                         message=warning.message)
        self.say(f"warning: {warning.message}")

    def launch_note(self) -> str | None:
        """For a fresh launch line after the warning, while the watched dir is still empty."""
        if self.warning is None or list_candidates(self.ckpt_dir):
            return None
        return short(self.warning)
