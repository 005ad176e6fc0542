"""The warm standby as the host of one node's ranks (proc/ranks.py has the supervisor's side).

Loaded by child_program.py by path, after the hand-off has set the attempt's environment,
working directory and log pipes: standard library only, torch imported by name (the standby
has imported it already; a script without it gets no store, and needs none). `host` forks one
process per rank, each of which returns from it to run the script as child_program runs it; the
host itself never returns. It does for one node what torchrun's agent does:

- each rank gets the variables the agent gives it (proc/ranks.rank_env), MASTER_PORT being the
  port of a socket the host listens on, picked by the kernel for this attempt;
- after the forks (a process that forks must not have started threads) the host serves torch's
  c10d TCPStore on that socket, the store the ranks' `init_process_group` reaches as the
  agent's store (TORCHELASTIC_USE_AGENT_STORE=True);
- the ranks share the host's process group, so rtrain's stop signal (and SIGKILL after its
  grace) reaches every rank as it reaches a single-process attempt; the host ignores such
  signals itself and waits for its ranks;
- when a rank fails, the others get SIGTERM, then SIGKILL after the grace; the host prints
  torchrun's failure summary (decide/classify.py reads its first observed failure) and exits 1,
  as torchrun does. All ranks succeeded: exit 0.

What differs from a rank under torchrun: the preloaded modules are imported before the rank
variables are set (as the RTRAIN_* ones, child_program.py); a rank's parent is the host, in
the host's process group, not a session of its own; TORCHELASTIC_ERROR_FILE lies in the
attempt's directory."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import sys
import time

POLL_S = 0.05
PR_SET_PDEATHSIG = 1
# Not ignored by the host: what the kernel sends for its own faults, and what it cannot catch.
KEEP = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGCONT, signal.SIGSEGV,
        signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT, signal.SIGTRAP,
        signal.SIGSYS}
HELP = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"


def _listen(addr: str) -> socket.socket:
    """A listening socket on the first address `addr` resolves to (the one the ranks' store
    clients try first), on a port the kernel picks."""
    family, kind, proto, _, where = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.bind(where[:2])
    sock.listen(128)
    return sock


def _die_with_parent() -> None:
    """A rank ends with its host (PDEATHSIG), as the host's whole group ends on SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _serve_store(addr: str, sock: socket.socket) -> object | None:
    """torch's c10d TCPStore on `sock`; None (said on stderr) when torch cannot give one."""
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore

        return TCPStore(addr, sock.getsockname()[1], None, True, timedelta(seconds=900),
                        wait_for_workers=False, master_listen_fd=sock.fileno())
    except Exception as e:  # a script without torch.distributed needs no store
        print(f"rtrain rank host: no c10d store ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _signal_all(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _traceback(code: int, pid: int, error_file: str) -> str:
    """The summary's traceback line, as torchrun words it."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"Signal {-code} ({name}) received by PID {pid}"
    try:
        message = json.loads(_read_small(error_file))["message"]
        text = message["message"] if isinstance(message, dict) else message
        return str(text).strip().splitlines()[-1] if str(text).strip() else HELP
    except (OSError, ValueError, KeyError, TypeError):
        return HELP


def _read_small(path: str, limit: int = 1 << 16) -> bytes:
    """A rank's error file, as rtrain opens a file in the run dir (core/ownfiles.py, which
    this program cannot import): no link followed, no FIFO waited on, a regular file only, a
    bounded read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def summary(name: str, failures: list[tuple[int, int, int, float, str]]) -> str:
    """torchrun's ChildFailedError text for `failures` (local rank, pid, exit code, time, error
    file), the first observed failure first."""
    host = socket.gethostname()

    def block(i: int, f: tuple[int, int, int, float, str]) -> list[str]:
        rank, pid, code, when, error_file = f
        exists = os.path.exists(error_file)
        return [f"[{i}]:",
                f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}",
                f"  host      : {host}",
                f"  rank      : {rank} (local_rank: {rank})",
                f"  exitcode  : {code} (pid: {pid})",
                f"  error_file: {error_file if exists else '<N/A>'}",
                f"  traceback : {_traceback(code, pid, error_file)}"]

    bar, rule = "=" * 60, "-" * 60
    lines = [bar, f"{name} FAILED", rule, "Failures:"]
    others = failures[1:]
    if not others:
        lines.append("  <NO_OTHER_FAILURES>")
    for i, f in enumerate(others, 1):
        lines += block(i, f)
    lines += [rule, "Root Cause (first observed failure):", *block(0, failures[0]), bar]
    return "\n".join(lines)


def host(spec: dict, set_cmdline) -> list[str]:
    """Fork the ranks of `spec` (proc/ranks.handoff); returns, in each rank, the argv the rank
    runs. In the host it never returns."""
    envs: list[dict[str, str]] = spec["envs"]
    grace_s = float(spec["grace_s"])
    listener = _listen(spec["addr"])
    port = str(listener.getsockname()[1])
    ranks: dict[int, int] = {}  # pid -> local rank
    sys.stdout.flush()
    sys.stderr.flush()
    for local_rank, env in enumerate(envs):
        try:
            pid = os.fork()
        except OSError as e:
            print(f"rtrain rank host: cannot fork rank {local_rank}: {e}", file=sys.stderr)
            _signal_all(ranks, signal.SIGKILL)
            os._exit(1)
        if pid == 0:
            listener.close()
            _die_with_parent()
            if os.getppid() == 1:
                os._exit(1)
            os.environ.update(env)
            os.environ["MASTER_PORT"] = port
            sys.orig_argv = list(spec["orig_argv"])
            set_cmdline(spec["orig_argv"])
            return list(spec["argv"])
        ranks[pid] = local_rank
    for sig in signal.valid_signals():
        if sig not in KEEP:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    store = _serve_store(spec["addr"], listener)
    code = _wait(ranks, envs, grace_s, spec.get("name") or "script")
    del store
    os._exit(code)


def _wait(ranks: dict[int, int], envs: list[dict[str, str]], grace_s: float, name: str) -> int:
    alive = dict(ranks)
    failures: list[tuple[int, int, int, float, str]] = []
    deadline: float | None = None
    while alive:
        if deadline is None:
            pid, status = os.waitpid(-1, 0)
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() >= deadline:
                    _signal_all(alive, signal.SIGKILL)
                    deadline = float("inf")  # blocking from here on is as good
                time.sleep(POLL_S)
                continue
        rank = alive.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failures.append((rank, pid, code, time.time(),
                             envs[rank].get("TORCHELASTIC_ERROR_FILE", "")))
            if deadline is None and alive:
                _signal_all(alive, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
    if not failures:
        return 0
    print(summary(name, failures), file=sys.stderr, flush=True)
    return 1
