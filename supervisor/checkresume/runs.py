"""One run of the user's script for check-resume: its own session (its loader workers with it),
dying with us, output into a log file, a deadline, and nothing of its group left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.proc.spawn import pdeathsig_preexec


class ScriptFailed(UsageError):
    """A run that could not serve the check (failed, timed out, did not stop where asked)."""


@dataclass(frozen=True)
class Ran:
    returncode: int  # negative: killed by that signal
    seconds: float
    log: Path

    def last_line(self) -> str:
        """The log's last non-empty line (a traceback's last line names the error)."""
        try:
            opened = ownfiles.open_own(self.log)
        except OSError:
            return ""
        try:
            tail = os.pread(opened.fd, 8192, max(0, opened.st.st_size - 8192))
        except OSError:
            return ""
        finally:
            os.close(opened.fd)
        lines = tail.decode(errors="replace").splitlines()
        return next((ln.strip() for ln in reversed(lines) if ln.strip()), "")[:300]


def run(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path,
        timeout_s: float) -> Ran:
    """Run `argv` to its end (or `timeout_s`, then SIGKILL to its group and ScriptFailed)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with os.fdopen(ownfiles.create_fresh(log), "wb") as out:  # never through a planted link
        try:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=pdeathsig_preexec(os.getpid()))
        except OSError as e:
            raise ScriptFailed(f"cannot start {argv[0]}: {e.strerror or e}") from None
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            raise ScriptFailed(f"the script was still running after {timeout_s:.0f} s "
                               f"(--timeout); its output: {log}") from None
        except BaseException:  # Ctrl-C: take the run along
            _kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            _kill_group(proc.pid)  # loader workers or helpers it left behind
    return Ran(code, time.monotonic() - began, log)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
