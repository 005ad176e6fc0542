"""A child rtrain did not fork itself but waits for as its parent: a process re-parented to it.

rtrain is a child subreaper (proc/spawn.py): a process whose parent exits becomes rtrain's
child. The warm standby's zygote forks each standby that way (standby/child_program.py), so the
standby is rtrain's child like a cold one and is watched, waited for and reaped the same way.
`Adopted` is the part of `subprocess.Popen` that the loop uses (`pid`, `returncode`, `poll`,
`wait`), with the same meaning of a negative status (killed by that signal); register it with
proc/reaper.own so that the orphan reaper leaves its exit status to it.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

from rtrain.supervisor.proc.reaper import own


class Adopted:
    """A child of ours by re-parenting, from the moment it is ours until it is reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.args = [str(pid)]  # what subprocess.TimeoutExpired names
        self.returncode: int | None = None
        own(self)  # type: ignore[arg-type]  # the same four members as a Popen

    def poll(self) -> int | None:
        if self.returncode is None:
            self._wait(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._wait(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._sleep(min(left, 0.05))
        return self.returncode  # type: ignore[return-value]

    def _sleep(self, seconds: float) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            time.sleep(min(seconds, 0.005))
            return
        try:
            select.select([fd], [], [], seconds)  # readable once it exits
        finally:
            os.close(fd)

    def _wait(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            # Not (or no longer) our child: reaped by someone else, its status is lost. As
            # subprocess does then, read it as ended rather than wait forever.
            self.returncode = 0 if self.returncode is None else self.returncode
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)
