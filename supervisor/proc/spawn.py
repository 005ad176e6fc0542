"""Start one attempt's child: own session, dies with us, output through pipes we tee.

The child gets a new session (so a terminal's Ctrl-C reaches only us, and we can signal its whole
process group) and PR_SET_PDEATHSIG=SIGKILL (so a SIGKILLed supervisor never leaves a training run
holding the GPU). The supervisor also becomes a child subreaper: descendants that escape the
group with setsid are re-parented to us instead of init, so the sweep after an attempt finds them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE, env_mode
from rtrain.supervisor.proc.logcap import CappedLog
from rtrain.supervisor.proc.reaper import own

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STDERR_TAIL_BYTES = 16 * 1024

# Loaded in the parent: the preexec hook runs between fork and exec and must not import or allocate.
_libc = ctypes.CDLL(None, use_errno=True)
_subreaper_set = False


@dataclass(frozen=True, kw_only=True)
class ChildSpec:
    """How to start one attempt."""

    argv: Sequence[str]
    """Program and arguments, e.g. `[sys.executable, "train.py", "--bs", "16"]`."""
    env: Mapping[str, str]
    """The child's complete environment (contract 1 variables included)."""
    cwd: str | os.PathLike[str]
    """Working directory of the child."""
    attempt_dir: Path
    """Created if missing; receives stdout.log and stderr.log."""
    echo: bool = False
    """Also copy the child's output to our own stdout/stderr (the user's terminal)."""
    echo_through: Callable[[bytes, BinaryIO], None] | None = None
    """Writes echoed output instead of a plain write, e.g. a status line that clears itself
    first (`StatusLine.write_through`)."""
    cgroup_dir: Path | None = None
    """Join this cgroup (a directory with `cgroup.procs`) before exec, e.g. a memory limit."""
    subreaper: bool = True
    """Make the supervisor a child subreaper so setsid escapees stay our descendants."""
    log_cap_bytes: int | None = None
    """Each log keeps at most about this much: its head and its newest output (logcap.py).
    None: no cap; `rtrain launch` passes its `log_cap_mb` setting."""

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("ChildSpec.argv is empty: give at least the program to run")


class OutputPipe:
    """One of the child's output pipes: read without blocking, copy to a log and the terminal."""

    def __init__(self, fd: int, log_path: Path, echo_to: BinaryIO | None, tail_bytes: int,
                 through: Callable[[bytes, BinaryIO], None] | None,
                 cap_bytes: int | None, mode: int = DEFAULT_FILE_MODE) -> None:
        self.fd = fd
        self.through = through
        os.set_blocking(fd, False)
        # Never raises for a full or failing disk, nor for a link planted at the name.
        self.log = CappedLog(log_path, cap_bytes, mode=mode)
        self.echo_to = echo_to
        self.tail_bytes = tail_bytes
        self.tail = bytearray()
        self.closed = False

    def pump(self) -> bool:
        """Copy what is there now. False once the pipe reached EOF (and is closed)."""
        while not self.closed:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            if not data:
                self.close()
                return False
            self.log.write(data)
            if self.echo_to is not None:
                if self.through is not None:
                    self.through(data, self.echo_to)
                else:
                    self.echo_to.write(data)
                    self.echo_to.flush()
            if self.tail_bytes:
                self.tail += data
                del self.tail[: max(0, len(self.tail) - self.tail_bytes)]
        return False

    def tail_text(self) -> str:
        return self.tail.decode("utf-8", errors="replace")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self.fd)
            self.log.close()


@dataclass(eq=False)
class Child:
    """A running attempt. `pgid == pid` (own session); `pidfd` is readable once it exits."""

    spec: ChildSpec
    popen: subprocess.Popen[bytes]
    pid: int
    pgid: int
    pidfd: int | None  # None on kernels before 5.3: watchers then poll
    stdout: OutputPipe
    stderr: OutputPipe
    started: float  # time.monotonic() just before the fork
    started_wall: float = field(default_factory=time.time)

    @property
    def returncode(self) -> int | None:
        """Reaps the child if it has exited; negative = killed by that signal (subprocess style)."""
        return self.popen.poll()

    def close(self) -> None:
        """Release our file descriptors (the process itself is stop.py's business)."""
        self.stdout.close()
        self.stderr.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def become_subreaper() -> None:
    global _subreaper_set
    if not _subreaper_set:
        if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("cannot become a child subreaper (errno %d)", ctypes.get_errno())
        _subreaper_set = True


def _preexec(parent_pid: int, cgroup_procs: bytes | None):
    def hook() -> None:
        # Tied to the forking thread: spawn from the supervisor's main thread.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)
        if cgroup_procs is not None:
            fd = os.open(cgroup_procs, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

    return hook


def pdeathsig_preexec(parent_pid: int):
    """For rtrain's own helper processes: they die with the supervisor, as the child does."""
    return _preexec(parent_pid, None)


def spawn(spec: ChildSpec) -> Child:
    """Start the child. Raises OSError (e.g. FileNotFoundError) when it cannot be started."""
    try:
        spec.attempt_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a full disk costs this attempt's logs until there is room, not the run
        if e.errno not in STORAGE_ERRNOS:
            raise
        log.warning("cannot create %s (%s); training starts anyway", spec.attempt_dir,
                    e.strerror)
    if spec.subreaper:
        become_subreaper()
    cgroup_procs = None
    if spec.cgroup_dir is not None:
        cgroup_procs = os.fsencode(Path(spec.cgroup_dir) / "cgroup.procs")
    # Our own pipes rather than subprocess.PIPE: we read raw fds and close them ourselves.
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    started, started_wall = time.monotonic(), time.time()
    try:
        popen = subprocess.Popen(
            list(spec.argv),
            env=dict(spec.env),
            cwd=spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=out_w,
            stderr=err_w,
            start_new_session=True,
            preexec_fn=_preexec(os.getpid(), cgroup_procs),
        )
        own(popen)
    except BaseException:
        for fd in (out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w):
            os.close(fd)
    try:
        pidfd: int | None = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        pidfd = None
    echo_out = sys.stdout.buffer if spec.echo else None
    echo_err = sys.stderr.buffer if spec.echo else None
    mode = env_mode(spec.env)  # the run's file mode, as the child gets it
    return Child(
        spec=spec,
        popen=popen,
        pid=popen.pid,
        pgid=popen.pid,
        pidfd=pidfd,
        stdout=OutputPipe(out_r, spec.attempt_dir / "stdout.log", echo_out, 0,
                          spec.echo_through, spec.log_cap_bytes, mode),
        stderr=OutputPipe(err_r, spec.attempt_dir / "stderr.log", echo_err, STDERR_TAIL_BYTES,
                          spec.echo_through, spec.log_cap_bytes, mode),
        started=started,
        started_wall=started_wall,
    )
