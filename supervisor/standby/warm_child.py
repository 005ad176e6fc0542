"""The warm standby process: spawned like a child, preloaded, handed an attempt.

`WarmChild.spawn` starts `standby/child_program.py` in the interpreter the attempt would use, with
what proc/spawn.py gives a cold child: its own session (pgid == pid), PDEATHSIG=SIGKILL, the same
cgroup, stdin from /dev/null, stdout and stderr on pipes, the environment the attempt would
have minus its RTRAIN_* variables (which change per attempt and are handed over later). It is
never forked from a training process. What it prints while it imports goes to `standby.log` in
the run dir.

Started as a zygote (`spawn(..., zygote=True)`), it imports and then forks standbys instead of
becoming an attempt: `fork` returns a WarmChild for each, ready within milliseconds. A forked
standby is the zygote's grandchild, re-parented to rtrain (a subreaper: proc/adopted.py waits
for it) and given there what a spawned one gets at spawn: its own session, PDEATHSIG tied to
rtrain (set once rtrain is its parent), the zygote's cgroup and environment, stdin from
/dev/null, its output into the zygote's pipes until the hand-off gives it the attempt's.

`activate` hands it an attempt: new log pipes (sent over the socket with SCM_RIGHTS, so the
attempt's stdout.log and stderr.log are written by the same OutputPipe as a cold child's), the
argv, environment and working directory; it answers once all is set, and the `Child` returned
is watched like any other.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from rtrain.supervisor.core.atomic_write import STORAGE_ERRNOS
from rtrain.supervisor.core.filemode import env_mode
from rtrain.supervisor.proc import ranks
from rtrain.supervisor.proc.adopted import Adopted
from rtrain.supervisor.proc.reaper import own
from rtrain.supervisor.proc.spawn import (
    STDERR_TAIL_BYTES,
    Child,
    ChildSpec,
    OutputPipe,
    _preexec,
    become_subreaper,
)
from rtrain.supervisor.standby import decide as policy
from rtrain.supervisor.standby.child_program import file_stamp, find_main_file, top_imports

CHILD_PROGRAM = Path(__file__).with_name("child_program.py")
HANDOFF_TIMEOUT_S = 10.0
"""From the hand-off to the standby's answer: it only sets a few things, so a longer silence
is a broken standby (then a cold start)."""
LOG_NAME = "standby.log"
CMDLINE_ROOM = 8192
"""Bytes of argument area kept for the attempt's command line (child_program.set_cmdline)."""
IMPORT_NICE = 19
"""The standby imports at this autogroup nice, so it takes CPU only that training leaves idle;
set back to the cold child's 0 before the hand-off (a session's autogroup nice may be raised
and lowered again without privileges, unlike a process's nice value)."""


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Best effort (kernels without autogroups scheduling: no effect); False when it failed."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


class StandbyFailed(Exception):
    """The standby died, failed to import, or did not answer: the attempt starts cold."""


@dataclass(frozen=True)
class Target:
    """What the standby will run, fixed when it is spawned."""

    python: str
    mode: str  # "script" or "module"
    target: str  # the script's absolute path, or the module name
    path0: str  # sys.path[0] as a cold start sets it
    argv0: str  # the script as the command names it (a cold start's sys.argv[0]); "-m"


def target_of(command: Sequence[str], cwd: Path) -> Target | None:
    """The standby's target for `command`; None when it is not `python SCRIPT.py ...` or
    `python -m MODULE ...` (another executable, interpreter options, a torchrun over several
    nodes). rtrain's torchrun over one node: the program its ranks run (proc/ranks.py)."""
    plan = ranks.plan_of(list(command))
    if plan is not None:
        command = plan.rank_argv()
    if len(command) < 2 or not Path(command[0]).name.startswith("python"):
        return None
    if command[1] == "-m":
        if len(command) < 3 or command[2].startswith(("torch.distributed", "-")):
            return None
        return Target(command[0], "module", command[2], str(Path(cwd).resolve()), "-m")
    if not command[1].endswith(".py") or command[1].startswith("-"):
        return None
    script = os.path.abspath(os.path.join(cwd, command[1]))
    return Target(command[0], "script", script, os.path.dirname(os.path.realpath(script)),
                  command[1])


def worth_keeping(target: Target, preload: Sequence[str] | None) -> bool:
    """False when the default preload would import nothing: a standby would then save only the
    interpreter's start (tens of ms). Judged here for rtrain's own interpreter; another one
    (`--python`) is given the benefit of the doubt, as its path differs from ours."""
    if preload is not None:
        return bool(preload)
    if os.path.realpath(target.python) != os.path.realpath(sys.executable):
        return True
    main = find_main_file(target.mode, target.target, target.path0)
    return bool(main and top_imports(main, target.path0))


def same_target(target: Target, argv: Sequence[str], cwd: Path) -> bool:
    """Whether an attempt's rendered argv runs what the standby preloaded for."""
    return target_of(argv, cwd) == target


def strip_attempt_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The part of an attempt's environment that a standby is started with."""
    return {k: v for k, v in env.items() if not k.startswith("RTRAIN_")}


class WarmChild:
    """One standby process, from spawn to hand-off or discard."""

    def __init__(self, target: Target, env: dict[str, str], popen: subprocess.Popen[bytes],
                 sock: socket.socket, outputs: list[OutputPipe], spawned_ns: int,
                 zygote: WarmChild | None = None) -> None:
        self.target, self.env, self.popen = target, env, popen
        self.pid = popen.pid
        self.sock = sock
        self.outputs = outputs  # the preload's stdout and stderr, into standby.log
        self.spawned_ns = spawned_ns  # wall clock, as the files' times are
        self.zygote = zygote  # the zygote it was forked from; None: it imported by itself
        self.ready: dict | None = None
        self.failed: str | None = None
        self._buf = bytearray()

    @classmethod
    def spawn(cls, target: Target, env: Mapping[str, str], cwd: Path, run_dir: Path,
              preload: Sequence[str] | None, cgroup_dir: Path | None = None,
              zygote: bool = False) -> WarmChild:
        """Start a standby (from the supervisor's main thread: PDEATHSIG is tied to it), or
        with `zygote` one that forks standbys (`fork`) instead of becoming an attempt."""
        become_subreaper()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        cgroup_procs = None if cgroup_dir is None else os.fsencode(cgroup_dir / "cgroup.procs")
        spawned_ns = time.time_ns()
        argv = [target.python, str(CHILD_PROGRAM), str(theirs.fileno()), target.mode,
                target.target, target.path0, json.dumps(None if preload is None
                                                        else list(preload)),
                target.argv0, "zygote" if zygote else "standby",
                " " * CMDLINE_ROOM]  # room for the attempt's argv in /proc/<pid>/cmdline
        try:
            popen = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=out_w, stderr=err_w, start_new_session=True,
                                     pass_fds=(theirs.fileno(),),
                                     preexec_fn=_preexec(os.getpid(), cgroup_procs))
        except BaseException:
            ours.close()
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            theirs.close()
            for fd in (out_w, err_w):
                os.close(fd)
        own(popen)  # its exit status is ours (and the attempt's) to read: never the reaper's
        ours.setblocking(False)
        set_autogroup_nice(popen.pid, IMPORT_NICE)  # its own session: its own autogroup
        log = run_dir / LOG_NAME
        mode = env_mode(env)
        outputs = [OutputPipe(fd, log, None, STDERR_TAIL_BYTES, None, 1 << 20, mode)
                   for fd in (out_r, err_r)]
        return cls(target, dict(env), popen, ours, outputs, spawned_ns)

    # ---------------------------------------------------------------- while it waits

    def poll(self) -> None:
        """Read what the standby said and printed so far (never blocks)."""
        for out in self.outputs:
            out.pump()
        while self.ready is None and self.failed is None:
            msg = self._message()
            if msg is None:
                break
            if "ready" in msg:  # a forked standby has what its zygote imported and recorded
                self.ready = {**(self.zygote.ready or {}), **msg} if self.zygote else msg
            else:
                self.failed = str(msg.get("failed") or "the standby said nothing usable")
        if self.failed is None and self.ready is None and self.popen.poll() is not None:
            self.failed = f"exited with status {self.popen.returncode} while importing"

    def _message(self) -> dict | None:
        while b"\n" not in self._buf:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return None
            except OSError as e:
                return {"failed": f"its socket failed: {e.strerror}"}
            if not data:
                return {"failed": f"closed its socket (exit status {self.popen.poll()})"}
            self._buf += data
        line, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        try:
            msg = json.loads(line)
        except ValueError:
            return {"failed": "sent a message that is not JSON"}
        return msg if isinstance(msg, dict) else {"failed": "sent a message that is no object"}

    def wait_ready(self, timeout_s: float,
                   interrupted: Callable[[], bool] = lambda: False) -> None:
        """Block until the standby is ready or failed, at most `timeout_s`, or until
        `interrupted()` (a stop signal: the wait must not delay it). An attempt waits for it:
        it imports at full speed from now on."""
        set_autogroup_nice(self.pid, 0)
        deadline = time.monotonic() + timeout_s
        self.poll()
        while self.ready is None and self.failed is None and not interrupted():
            left = deadline - time.monotonic()
            if left <= 0:
                self.failed = f"not ready after {timeout_s:g} s"
                return
            select.select([self.sock, *[o.fd for o in self.outputs if not o.closed]], [], [],
                          min(left, 0.5))
            self.poll()

    def fork(self) -> WarmChild:
        """A standby forked from this ready zygote: ready within milliseconds, as it imports
        nothing (standby/child_program.py forks it). Raises StandbyFailed."""
        if self.ready is None or not self.ready.get("zygote"):
            raise StandbyFailed(self.failed or "the zygote is not ready")
        # It imported at the lowest priority; a fork on a busy host must not wait for CPU (the
        # supervisor waits for its answer). Idle between forks, it costs nothing at 0.
        set_autogroup_nice(self.pid, 0)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(HANDOFF_TIMEOUT_S)
            socket.send_fds(self.sock, [b'{"fork": 1}\n'], [theirs.fileno()])
            answer = self._answer()
        except (OSError, StandbyFailed) as e:
            ours.close()
            raise StandbyFailed(str(e) if isinstance(e, StandbyFailed)
                                else f"the zygote failed: {e.strerror or e}") from None
        finally:
            theirs.close()
            self.sock.setblocking(False)
        pid = answer.get("forked")
        if not isinstance(pid, int) or pid <= 0:
            ours.close()
            raise StandbyFailed(str(answer.get("failed") or "the zygote did not fork"))
        popen = Adopted(pid)  # re-parented to us before the zygote answered
        ours.setblocking(False)
        return WarmChild(self.target, self.env, popen, ours, [],  # type: ignore[arg-type]
                         self.spawned_ns, zygote=self)

    def rss(self) -> int | None:
        try:
            return psutil.Process(self.pid).memory_info().rss
        except psutil.Error:
            return None

    def output_tail(self) -> str:
        outputs = self.zygote.outputs if self.zygote is not None else self.outputs
        return "".join(o.tail_text() for o in outputs)[-2000:]

    def stale_files(self) -> list[str]:
        """Files the standby runs code from (every module it imported, the libraries mapped
        into it, the script and the files its default preload was read from) that changed
        since it recorded them after its imports (standby/decide.changed_files). A stat each:
        for torch with torch._dynamo (1,900 files) about 5 ms idle, 10-30 ms on two busy
        cores: cheap enough for the supervisor every 10 s and at the hand-off."""
        ready = self.ready or {}
        recorded = ready.get("files")
        if not isinstance(recorded, dict):
            return ["its list of imported files"]  # unreadable: never hand it an attempt
        return policy.changed_files(recorded, {p: file_stamp(p) for p in recorded},
                                    self.spawned_ns, int(ready.get("stamped_ns") or 0))

    # ---------------------------------------------------------------- its end

    def activate(self, spec: ChildSpec, extra: Mapping[str, object] | None = None) -> Child:
        """Hand the attempt `spec` to the ready standby; raises StandbyFailed. `extra`: more
        for the hand-off message (the ranks it hosts: proc/ranks.handoff)."""
        if self.ready is None:
            raise StandbyFailed(self.failed or "not ready")
        if not set_autogroup_nice(self.pid, 0) and Path(f"/proc/{self.pid}/autogroup").exists():
            self.kill()
            raise StandbyFailed("cannot set its scheduling priority back to a cold child's")
        try:
            spec.attempt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno not in STORAGE_ERRNOS:
                raise
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        started, started_wall = time.monotonic(), time.time()
        msg = json.dumps({"argv": list(spec.argv), "env": dict(spec.env),
                          "cwd": str(spec.cwd), **(extra or {})}).encode() + b"\n"
        try:
            self.sock.setblocking(True)
            self.sock.settimeout(HANDOFF_TIMEOUT_S)
            sent = socket.send_fds(self.sock, [msg], [out_w, err_w])
            if sent < len(msg):
                self.sock.sendall(msg[sent:])
            answer = self._answer()
        except (OSError, StandbyFailed) as e:
            for fd in (out_r, err_r):
                os.close(fd)
            self.kill()
            raise StandbyFailed(str(e) if isinstance(e, StandbyFailed)
                                else f"hand-off failed: {e.strerror or e}") from None
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
        if "started" not in answer:
            for fd in (out_r, err_r):
                os.close(fd)
            self.kill()
            raise StandbyFailed(str(answer.get("failed") or "no answer to the hand-off"))
        for out in self.outputs:  # the preload's last words, then these pipes are done
            out.pump()
            out.close()
        self.sock.close()
        try:
            pidfd: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            pidfd = None
        echo_out = sys.stdout.buffer if spec.echo else None
        echo_err = sys.stderr.buffer if spec.echo else None
        mode = env_mode(spec.env)
        return Child(
            spec=spec, popen=self.popen, pid=self.pid, pgid=self.pid, pidfd=pidfd,
            stdout=OutputPipe(out_r, spec.attempt_dir / "stdout.log", echo_out, 0,
                              spec.echo_through, spec.log_cap_bytes, mode),
            stderr=OutputPipe(err_r, spec.attempt_dir / "stderr.log", echo_err,
                              STDERR_TAIL_BYTES, spec.echo_through, spec.log_cap_bytes, mode),
            started=started, started_wall=started_wall)

    def _answer(self) -> dict:
        deadline = time.monotonic() + HANDOFF_TIMEOUT_S
        while True:
            if b"\n" in self._buf:
                line, _, rest = bytes(self._buf).partition(b"\n")
                self._buf = bytearray(rest)
                try:
                    msg = json.loads(line)
                except ValueError:
                    raise StandbyFailed("answered the hand-off with no JSON") from None
                return msg if isinstance(msg, dict) else {}
            if time.monotonic() > deadline:
                raise StandbyFailed(f"no answer to the hand-off in {HANDOFF_TIMEOUT_S:g} s")
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise StandbyFailed(f"no answer to the hand-off in {HANDOFF_TIMEOUT_S:g} s"
                                    ) from None
            if not data:
                raise StandbyFailed(f"exited during the hand-off (status {self.popen.wait()})")
            self._buf += data

    def kill(self) -> None:
        """End the standby and its group, reap it, close what we hold."""
        # A process killed while it imports at nice 19 still has its memory to free before it
        # is gone; on busy cores that waits for CPU, and the launch's end waits for it.
        set_autogroup_nice(self.pid, 0)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for out in self.outputs:
            out.pump()
            out.close()
        self.sock.close()


__all__ = ["StandbyFailed", "Target", "WarmChild", "same_target",
           "strip_attempt_vars", "target_of"]
