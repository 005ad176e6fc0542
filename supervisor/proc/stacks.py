"""Python stacks of a hung attempt, written into its attempt directory before it is stopped.

Two sources, because either may fail: the worker's faulthandler (on RTRAIN_DUMP_SIGNAL, written
from C inside the signal handler, so it works while the interpreter is stuck in a C call), and
py-spy, which reads the process from outside and also covers scripts without the worker library.
Both files get the run's file mode (owner-only by default) and are opened through
`ownfiles.open_own`: never through a link planted at the name, appended to, never truncated.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE
from rtrain.supervisor.proc.reaper import own

log = logging.getLogger(__name__)

_RESUME_CHECK_S = 0.1  # after the dumps, how long a SIGSTOP left by py-spy may take to land


def find_pyspy() -> str | None:
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if os.access(beside, os.X_OK) else None


def catches(pid: int, sig: int) -> bool:
    """Whether `pid` has a handler for `sig` (SigCgt): sending it to others would kill them."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


def _is_python(proc: psutil.Process) -> bool:
    try:
        return "python" in proc.name().lower() or "python" in os.path.basename(proc.exe()).lower()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def dump_stacks(
    pids: Iterable[int], attempt_dir: Path, dump_signal: int, timeout_s: float,
    mode: int = DEFAULT_FILE_MODE,
) -> list[Path]:
    """Ask every process for its stacks; return the py-spy files written (bounded by timeout_s).

    Workers write `stacks-<pid>.txt` themselves; py-spy output goes to `stacks-pyspy-<pid>.txt`.
    """
    pids = list(pids)
    for pid in pids:
        if catches(pid, dump_signal):
            try:
                os.kill(pid, dump_signal)
            except ProcessLookupError:
                pass
    pyspy = find_pyspy()
    if pyspy is None:
        return []
    running: list[tuple[subprocess.Popen[bytes], Path]] = []
    paused: list[int] = []  # running processes py-spy pauses (ptrace) while it reads them
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            stopped = proc.status() == psutil.STATUS_STOPPED
        except psutil.NoSuchProcess:
            continue
        if not _is_python(proc):
            continue
        if not stopped:
            paused.append(pid)
        # py-spy cannot suspend an already stopped process; reading it without pausing works.
        argv = [pyspy, "dump", "--pid", str(pid)] + (["--nonblocking"] if stopped else [])
        path = attempt_dir / f"stacks-pyspy-{pid}.txt"
        try:
            fd = ownfiles.open_own(path, os.O_WRONLY | os.O_APPEND, create=True, mode=mode).fd
        except OSError as e:  # a refused name (a planted link) or a full disk: no dump
            log.warning("no py-spy stacks for pid %d: %s", pid, e)
            continue
        try:
            running.append((own(subprocess.Popen(argv, stdout=fd, stderr=subprocess.STDOUT)),
                            path))
        finally:
            os.close(fd)
    deadline = time.monotonic() + timeout_s
    for proc, _ in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    resume(paused)
    return [path for _, path in running]


def resume(pids: list[int]) -> None:
    """Undo a pause py-spy left behind. A py-spy killed at the timeout while attached (and, at
    times, one that exits normally) leaves its target in a job-control stop: the SIGSTOP of its
    ptrace attach lands once it is gone. A stopped process cannot run its save at a hang, so
    the grace would pass with nothing saved. SIGCONT also discards a SIGSTOP still pending."""
    for pid in pids:
        _cont(pid)
    if not pids:
        return
    time.sleep(_RESUME_CHECK_S)  # a stop being delivered as the tracer went lands by now
    for pid in pids:
        try:
            status = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            continue
        if status == psutil.STATUS_STOPPED:
            log.warning("PID %d was left stopped by py-spy; resumed it", pid)
            _cont(pid)


def _cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
