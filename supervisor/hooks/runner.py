"""`[[hooks]]`: run a command with an event's JSON on stdin when the supervisor records it.

    [[hooks]]
    on = ["give_up", "degrade", "hang"]
    command = ["notify-send", "rtrain"]
    timeout_s = 10

A name in `on` matches an event of that kind, or a `classification` whose failure is that kind
(`hang`, `oom_gpu`, ...). A hook never blocks supervision: it is spawned (own session, stdin and
stderr in unlinked temp files, so no pipe can fill) and left running; the loop polls it at each
event and each watch tick, kills its process group at its deadline, and records a `hook_failed`
event for a non-zero exit, a timeout or a command that cannot start. At the end of `rtrain
launch` the hooks still running get until their deadline (a give-up alert is not cut short).
Hook processes are kept out of the attempt's process tree (`pids()`), so they are neither
counted as training memory nor swept with the attempt. A hook's environment is rtrain's without
secrets (`hashing.SECRET_ENV`: the signing and encryption keys), plus RTRAIN_RUN_DIR and
RTRAIN_EVENT.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rtrain.checkpoint.hashing import SECRET_ENV
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.hooks.hook_spec import HookSpec
from rtrain.supervisor.proc.reaper import own

log = logging.getLogger(__name__)

_STDERR_TAIL = 2000


@dataclass
class _Running:
    hook: HookSpec
    event: dict[str, Any]
    proc: subprocess.Popen[bytes]
    deadline: float
    stderr: IO[bytes]


@dataclass
class HookRunner:
    """An EventLog listener that starts matching hooks; `poll()` reaps them (call it often).

    `report(kind, **fields)` records a hook's failure (the launch loop passes EventLog.emit).
    It is called only from `poll`/`close` on the caller's thread, never from inside a listener
    call, so events are written in order from one thread.
    """

    hooks: tuple[HookSpec, ...]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)
    """Added to the hook's environment (RTRAIN_RUN_DIR)."""
    clock: Callable[[], float] = time.monotonic
    report: Callable[..., Any] | None = None
    running: list[_Running] = field(default_factory=list)
    _failures: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("kind") == Kind.HOOK_FAILED:
            return
        for hook in self.hooks:
            if hook.matches(event):
                self._start(hook, event)

    def pids(self) -> list[int]:
        """Pids of hooks still running: roots of subtrees that are not the attempt's."""
        return [r.proc.pid for r in self.running]

    def _start(self, hook: HookSpec, event: dict[str, Any]) -> None:
        # A hook gets our environment minus secrets: a notifier has no use for the keys,
        # and whatever it runs (curl, a chat client) should not be able to leak it.
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        env.update(self.env, RTRAIN_EVENT=str(event.get("kind")))
        # Files, not pipes: a hook that never reads stdin or writes much to stderr cannot block
        # us. stderr stays open until the hook is reaped (its tail goes into hook_failed).
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed when the hook is reaped
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps(event, default=str).encode() + b"\n")
            stdin.seek(0)
            try:
                proc = subprocess.Popen(list(hook.command), stdin=stdin,
                                        stdout=subprocess.DEVNULL, stderr=stderr, cwd=self.cwd,
                                        env=env, start_new_session=True)
                own(proc)
            except OSError as err:
                stderr.close()
                self._failed(hook, event, f"cannot run {hook.command[0]!r}: "
                                          f"{err.strerror or err}")
                return
        self.running.append(_Running(hook, event, proc, self.clock() + hook.timeout_s, stderr))

    def _failed(self, hook: HookSpec, event: dict[str, Any], reason: str, **fields: Any) -> None:
        log.warning("hook %s on %s failed: %s", list(hook.command), event.get("kind"), reason)
        self._failures.append({"command": list(hook.command), "event": event.get("kind"),
                               "event_seq": event.get("seq"), "reason": reason, **fields})

    def poll(self) -> None:
        """Reap finished hooks, kill those past their deadline, report failures. Never blocks."""
        now = self.clock()
        still = []
        for r in self.running:
            code = r.proc.poll()
            if code is None and now >= r.deadline:
                _kill_group(r.proc)
                self._failed(r.hook, r.event, f"timed out after {r.hook.timeout_s:g} s; killed",
                             returncode=None, stderr=_tail(r.stderr))
                r.stderr.close()
            elif code is None:
                still.append(r)
            else:
                if code != 0:
                    how = (f"killed by {_signame(-code)}" if code < 0
                           else f"exited with code {code}")
                    self._failed(r.hook, r.event, how, returncode=code, stderr=_tail(r.stderr))
                r.stderr.close()
        self.running = still
        failures, self._failures = self._failures, []
        if self.report is not None:
            for fields in failures:
                self.report(Kind.HOOK_FAILED, **fields)

    def close(self) -> None:
        """Give running hooks until their deadlines, then kill them; report every failure."""
        while self.running:
            self.poll()
            if self.running:
                time.sleep(0.02)
        self.poll()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the hook and its children
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(f: IO[bytes]) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - _STDERR_TAIL))
    return f.read().decode(errors="replace").strip()


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
