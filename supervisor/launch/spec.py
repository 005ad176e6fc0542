"""What `rtrain launch` was asked to run (`LaunchSpec`, `child_command`) and everything outside
the process that tests replace (`Seams`)."""

from __future__ import annotations

import os
import random
import select
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.proc.gpu import GpuReader
from rtrain.supervisor.proc.signals import SignalCatcher
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.watch import watch


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What `rtrain launch` was asked to run."""

    command: list[str]
    """The child's argv, knob templates (`{batch_size}`) not yet filled in."""
    config: Config
    fresh: bool = False
    """Start the run over even when state.json says it finished."""
    retry: bool = False
    """Relaunch a run that gave up: fresh budgets, quarantines lifted (a person decided)."""
    echo: bool = True
    """Tee the child's output to our terminal (always also to attempts/<n>/)."""
    cwd: Path = field(default_factory=Path.cwd)
    resume_args: tuple[str, ...] = ()
    """Appended to the child's argv, templates filled in, only when resuming from a checkpoint
    (`--resume-arg "--resume_from_checkpoint {checkpoint}"`, shell-split)."""
    features: tuple[str, ...] | None = None
    """The optional features' modules, in order; None: all of them (supervisor/features.py)."""


def interrupted_wait(seconds: float, signals: SignalCatcher) -> bool:
    """Sleep up to `seconds`; True as soon as a stop signal arrives."""
    deadline = time.monotonic() + seconds
    fd = signals.fileno()
    while not signals.pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if fd is None:
            time.sleep(min(left, 0.1))
        else:
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                try:
                    os.read(fd, 512)
                except BlockingIOError:
                    pass
    return True


def _say(line: str) -> None:
    print(f"rtrain: {line}", file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Seams:
    """Everything outside the process that tests replace. The loop sleeps, spawns, watches and
    reads the clock only through these (the one exception: the real time an attempt started,
    which is compared with checkpoint mtimes on disk)."""

    gpu: GpuReader | None = None
    """The GPU reader; default NVML (says once when there is none)."""
    rand: Callable[[], float] = random.random
    """The backoff's jitter."""
    wall: Callable[[], float] = time.time
    """Unix time for records (events, state.json)."""
    monotonic: Callable[[], float] = time.monotonic
    """Durations and throttles (an attempt's length, heartbeat summaries, record waits)."""
    sleep: Callable[[float], None] = time.sleep
    """Plain waits: room on a full disk, a dead child's GPU memory being released."""
    backoff: Callable[[float, SignalCatcher], bool] = interrupted_wait
    """Sleeps the backoff before a relaunch; True when a stop signal cut it short."""
    spawn: Callable = spawn
    """Starts an attempt (`proc.spawn.spawn`: ChildSpec -> Child)."""
    watch: Callable = watch
    """Watches it to its end (`proc.watch.watch`: Child, WatchConfig, ... -> Outcome)."""
    say: Callable[[str], None] = _say
    """A line for the person at the terminal."""


def child_command(script: str | None, module: str | None, args: list[str],
                  python: str | None = None) -> list[str]:
    """The argv to run: `python SCRIPT ARGS`, `python -m MODULE ARGS`, or an executable as is
    (e.g. `torchrun ...`)."""
    py = python or sys.executable
    if module:
        # The module's first argument lands in the SCRIPT slot (`-m pkg --lr 1`): keep it.
        return [py, "-m", module, *([script] if script is not None else []), *args]
    if script is None:
        raise UsageError("nothing to launch: give a script (train.py), -m module, or a command "
                         "after --")
    if script.endswith(".py"):
        if not Path(script).is_file():
            raise UsageError(f"no such script {script!r} (relative to {Path.cwd()})")
        return [py, script, *args]
    exe = shutil.which(script)
    if exe is None:
        raise UsageError(f"{script!r} is neither a .py script nor a command on PATH")
    return [script, *args]
