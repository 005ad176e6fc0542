"""The run directory's state: creating the dirs, loading state.json for this launch (new run,
continued run, --fresh, --retry), saving it at decisions, and keeping it (and the events) for a
later try while the disk is full. Supervision itself never waits for the disk; only the end of
the run waits, bounded, for room to record how it ended.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

from rtrain.checkpoint.generation import GENERATION_FILE
from rtrain.checkpoint.quarantine import QUARANTINE_FILE
from rtrain.supervisor.core import filemode, ownfiles
from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.errors import ExitCode, UsageError
from rtrain.supervisor.decide.policy import History
from rtrain.supervisor.proc.leftovers import PROCS_FILE
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.records.lock import LOCK_NAME
from rtrain.supervisor.records.runstate import (
    STATE_FILE,
    RunState,
    RunStatus,
    load_state,
    save_state,
)

# A run that ends while the run dir's disk is full waits this long for room to record how it
# ended (state.json, the last events); supervision itself never waits for the disk.
RECORD_WAIT_S = 60.0


def prepare_dirs(run_dir: Path, ckpt_dir: Path, file_mode: int) -> None:
    """Create the run and checkpoint dirs under the file-mode policy. One rtrain cannot write
    to (read-only, not ours) is a usage error before anything starts, not a traceback."""
    where = run_dir
    try:
        filemode.make_dir(run_dir, file_mode)
        fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".rtrain-probe-")
        os.close(fd)
        os.unlink(probe)
        where = ckpt_dir
        filemode.make_dir(ckpt_dir, file_mode)
    except OSError as e:
        flag = "--run-dir" if where == run_dir else "--ckpt-dir"
        raise UsageError(f"cannot write to {where} ({e.strerror}): give a writable {flag} "
                         "or fix its permissions") from None


# The files a launch keeps in the run and checkpoint dirs. Written in place: each must be a
# regular file of one name (the features name theirs: supervisor/features.py `in_place`).
# Replaced whole (temp file + rename) and read back: a regular file.
IN_PLACE = {"run": (LOCK_NAME, "events.jsonl"), "ckpt": (GENERATION_FILE,)}
REPLACED = {"run": (STATE_FILE, PROCS_FILE), "ckpt": (QUARANTINE_FILE,)}


def refuse_planted(run_dir: Path, ckpt_dir: Path,
                   features: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """RefusedFile (exit 2) when a name the launch writes holds a link, a FIFO, a device or a
    second name of another file: checked (lstat, nothing opened) before anything is written,
    so the launch stops before it locks, records or starts anything. Each open checks again
    (ownfiles), for what appears meanwhile."""
    for where, root in (("run", run_dir), ("ckpt", ckpt_dir)):
        for name in (*IN_PLACE[where], *(features or {}).get(where, ())):
            ownfiles.check(root / name, in_place=True)
        for name in REPLACED[where]:
            ownfiles.check(root / name, in_place=False)


def move_aside(path: Path, now: float) -> None:
    """Rename `path` to `<name>.old-<time>[-n]`, never over an earlier one."""
    for n in range(1000):
        target = path.with_name(f"{path.name}.old-{int(now)}" + (f"-{n}" if n else ""))
        if not target.exists():
            path.rename(target)
            return
    raise UsageError(f"too many old copies of {path} beside it: remove some")


def refuse_ended(state: RunState, run_dir: Path, *, retry: bool,
                 say: Callable[[str], None]) -> int | None:
    """The exit code when this launch must not run the run again (it finished, or gave up and
    no --retry was given); None when it may."""
    if state.status is RunStatus.FINISHED:
        say(f"the run in {run_dir} already finished ({state.reason}); nothing to do (pass "
            "--fresh to run it again)")
        return 0
    if state.status is RunStatus.GAVE_UP and not retry:
        # A wrapper (cron, a Slurm batch script) repeating the command must not restart a
        # hopeless run forever: it gets its own exit code and can stop requeueing.
        say(f"the run in {run_dir} gave up: {state.reason}. Not relaunching "
            f"(exit {int(ExitCode.GAVE_UP_EARLIER)}); fix the cause, then pass --retry "
            "to relaunch it with fresh budgets, or --fresh to start over")
        return ExitCode.GAVE_UP_EARLIER
    return None


class RunRecord:
    """state.json of one launch, and the event log's held records at the run's end."""

    def __init__(self, run_dir: Path, file_mode: int, events: EventLog, *,
                 wall: Callable[[], float], monotonic: Callable[[], float],
                 sleep: Callable[[float], None], say: Callable[[str], None]) -> None:
        self.run_dir, self.file_mode, self.events = run_dir, file_mode, events
        self.wall, self.monotonic, self.sleep, self.say = wall, monotonic, sleep, say
        self.state = RunState(command=[], cwd="")
        self.new_run = True
        """No earlier state to continue (or --fresh / --retry): --resume applies."""
        self.unsaved = False
        """state.json could not be written (disk full): retried at samples and at the end."""

    def load(self, command: list[str], cwd: Path, *, fresh: bool, retry: bool) -> RunState:
        now = self.wall()
        old = load_state(self.run_dir)
        # --resume never / PATH apply to the first launch of a new run (or a --retry) only; a
        # run continued (requeued, relaunched by cron) resumes from its newest checkpoint.
        self.new_run = old is None or fresh or retry
        attempts = self.run_dir / "attempts"
        if fresh and attempts.exists():
            # A fresh run numbers its attempts from 0 again; the old run's logs are kept aside.
            move_aside(attempts, now)
        if old is None or fresh:
            self.state = RunState(command=command, cwd=str(cwd), created=now, updated=now)
            return self.state
        if old.command != command:
            self.say(f"note: {self.run_dir} was started with a different command "
                     f"({' '.join(old.command)}); continuing the run with this one")
        history = old.history
        if retry:
            # A person decided to try again: new budgets and no quarantine, same rung and
            # attempt numbering.
            history = replace(history, budgets_used={}, total_restarts=0, stalled=(),
                              failure_times=(), streak=None, quarantined=())
        self.state = replace(old, command=command, history=history)
        return self.state

    def save(self, status: RunStatus, reason: str, history: History) -> None:
        self.state = replace(self.state, status=status, reason=reason, history=history,
                             updated=self.wall())
        self.write()

    def write(self) -> bool:
        """Write state.json; on a full or failing disk keep it for a later try (the samples'
        ticks and the end of the run) instead of stopping the supervision."""
        try:
            save_state(self.run_dir, self.state, mode=self.file_mode)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
            if not self.unsaved:
                self.say(f"cannot write state.json in {self.run_dir} ({e.strerror}): kept "
                         "until there is room; training goes on")
            self.unsaved = True
            return False
        self.unsaved = False
        return True

    def retry_held(self) -> None:
        """A sample's tick: write what the full disk held back, events first."""
        if self.events.retry() and self.unsaved:
            self.write()

    def record_final(self) -> None:
        """Wait (bounded) for room to write the events and state.json that are still held."""
        deadline, told = self.monotonic() + RECORD_WAIT_S, False
        while not self.events.retry() or (self.unsaved and not self.write()):
            if self.monotonic() >= deadline:
                self.say(f"no room in {self.run_dir} after {RECORD_WAIT_S:g} s: "
                         f"{self.events.pending} events"
                         + (" and state.json" if self.unsaved else "") + " not recorded")
                return
            if not told:
                self.say(f"waiting up to {RECORD_WAIT_S:g} s for room in {self.run_dir} to "
                         "record how the run ended")
                told = True
            self.sleep(0.5)
