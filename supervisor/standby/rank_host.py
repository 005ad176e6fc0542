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

Over several nodes the store is not the host's to pick: the forked ranks wait on a pipe while
the host joins torch's rendezvous as torchrun's agent would (standby/rank_rdzv.py), then each
gets its rank, the world's size and the round's store from it. The rendezvous runs threads,
which is why the ranks are forked first. A rank that ends before the rendezvous is done (a stop
signal) ends the attempt; a rendezvous that fails ends it as it ends torchrun (its traceback,
status 1); a group that ended well waits at the agents' exit barrier; either way the host then
shuts the rendezvous down, as torchrun does. Over a range of nodes (`--nnodes MIN:MAX`) the host
also watches the rendezvous' wait list while its ranks run, as the agent's monitor loop does: a
node waiting to join is taken in at the next round, so the ranks get the stop signal (they
save at it; the arriving node's attempt fences off no commit of theirs; SIGKILL after the
grace) and the host exits 75 without
shutting the rendezvous down (the agent keeps it open for that round too). The supervisor
relaunches at once, spending nothing (a stop on its own, decide/classify.py), from its next
standby, and that host joins the round that takes the node in.

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
GROW_EXIT = 75
"""The host's status when it stopped its group for a node waiting to join: EX_TEMPFAIL, a stop
on its own, which the supervisor relaunches without charging or waiting (decide/policy.py)."""
GROW_LINE = "rtrain rank host: {n} node(s) waiting to join the rendezvous; the group restarts" \
    " to take them in"
"""What the host says then (decide/classify.py names the stop from it)."""


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


def summary(name: str, failures: list[tuple[int, int, int, float, str]],
            global_ranks: dict[int, int] | None = None) -> str:
    """torchrun's ChildFailedError text for `failures` (local rank, pid, exit code, time, error
    file), the first observed failure first; `global_ranks`: each local rank's rank in the
    group, where it differs (several nodes)."""
    host = socket.gethostname()

    def block(i: int, f: tuple[int, int, int, float, str]) -> list[str]:
        rank, pid, code, when, error_file = f
        grank = global_ranks.get(rank, rank) if global_ranks else rank
        exists = os.path.exists(error_file)
        return [f"[{i}]:",
                f"  time      : {time.strftime('%Y-%m-%d_%H:%M:%S', time.localtime(when))}",
                f"  host      : {host}",
                f"  rank      : {grank} (local_rank: {rank})",
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
    several = spec.get("rdzv")  # several nodes: the rendezvous gives the rest of each env
    listener = None if several else _listen(spec["addr"])
    port = "" if listener is None else str(listener.getsockname()[1])
    ranks: dict[int, int] = {}  # pid -> local rank
    writers: dict[int, int] = {}  # local rank -> the pipe its rendezvous variables come by
    sys.stdout.flush()
    sys.stderr.flush()
    for local_rank, env in enumerate(envs):
        reader = -1
        if several:
            reader, writers[local_rank] = os.pipe()
        try:
            pid = os.fork()
        except OSError as e:
            print(f"rtrain rank host: cannot fork rank {local_rank}: {e}", file=sys.stderr)
            _signal_all(ranks, signal.SIGKILL)
            os._exit(1)
        if pid == 0:
            if listener is not None:
                listener.close()
            _die_with_parent()
            if os.getppid() == 1:
                os._exit(1)
            os.environ.update(env)
            if several:
                for fd in writers.values():
                    os.close(fd)
                os.environ.update(_rendezvous_env(reader))
            else:
                os.environ["MASTER_PORT"] = port
            sys.orig_argv = list(spec["orig_argv"])
            set_cmdline(spec["orig_argv"])
            return list(spec["argv"])
        if several:
            os.close(reader)
        ranks[pid] = local_rank
    for sig in signal.valid_signals():
        if sig not in KEEP:
            try:
                signal.signal(sig, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    name = spec.get("name") or "script"
    if several:
        joined = _join(several, ranks, writers, envs, name)
        alive = dict(ranks)
        grow = _Membership(joined, alive, grace_s) if joined.elastic else None
        code = _wait(ranks, envs, grace_s, name, alive=alive,
                     stopping=(lambda: grow.waiting > 0) if grow else (lambda: False))
        if grow is not None:
            grow.close()
            if grow.waiting and code != 0:  # ranks that all ended well finished the run
                print(GROW_LINE.format(n=grow.waiting), file=sys.stderr, flush=True)
                os._exit(GROW_EXIT)  # the rendezvous stays open for the round that takes it
        if code == 0:
            joined.exit_barrier()
        joined.shutdown()
        os._exit(code)
    store = _serve_store(spec["addr"], listener)
    code = _wait(ranks, envs, grace_s, name)
    del store
    os._exit(code)


def _rendezvous_env(reader: int) -> dict[str, str]:
    """In a rank over several nodes: its rendezvous variables, which the host writes once it
    has joined (nothing: the host gave up, and so does the rank)."""
    data = b""
    while chunk := os.read(reader, 1 << 16):
        data += chunk
    os.close(reader)
    try:
        env = json.loads(data)
    except ValueError:
        os._exit(1)
    if not isinstance(env, dict):
        os._exit(1)
    return {str(k): str(v) for k, v in env.items()}


def _rank_rdzv():
    """standby/rank_rdzv.py, beside this file, loaded by path as this file is."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_rdzv.py")
    found = importlib.util.spec_from_file_location("_rtrain_rank_rdzv", path)
    if found is None or found.loader is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


def _join(several: dict, ranks: dict[int, int], writers: dict[int, int],
          envs: list[dict[str, str]], name: str):
    """Join the rendezvous (in a thread, while the ranks are watched: a rank that ends first,
    a stop signal's doing, ends the attempt), then send each rank its variables. Exits the
    host when the rendezvous fails, as torchrun exits: its traceback, status 1."""
    import threading
    import traceback

    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["joined"] = _rank_rdzv().join(several["torchrun"],
                                                 several.get("short_last_call", True),
                                                 several.get("failed_at"))
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, name="rtrain-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(POLL_S)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in ranks:  # ended before it started: the others too, no rendezvous kept
            local = ranks.pop(pid)
            _signal_all(ranks, signal.SIGKILL)
            failure = (local, pid, os.waitstatus_to_exitcode(status), time.time(),
                       envs[local].get("TORCHELASTIC_ERROR_FILE", ""))
            print(summary(name, [failure]), file=sys.stderr, flush=True)
            os._exit(1)
    if "error" in result:
        e = result["error"]
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        sys.stderr.flush()
        _signal_all(ranks, signal.SIGKILL)
        os._exit(1)
    joined = result["joined"]
    for local, env in enumerate(joined.envs()):
        envs[local].update(env)
        data = json.dumps(env).encode()
        try:
            while data:
                data = data[os.write(writers[local], data):]
        except OSError:
            pass  # that rank is gone: _wait hears of it
        os.close(writers[local])
    return joined


class _Membership:
    """Over a range of nodes, while the ranks run: the rendezvous' wait list, read every
    `--monitor-interval` as the agent reads it. A node waiting there stops the group: the
    ranks get the stop signal the worker saves on (RTRAIN_STOP_SIGNAL, else SIGTERM, as the
    agent's), SIGKILL after the grace. A wait list the host cannot read (the rendezvous'
    store went with a lost node) restarts nothing: the ranks' own collectives say whether the
    group still stands."""

    def __init__(self, joined, alive: dict[int, int], grace_s: float) -> None:
        import threading

        self.joined, self.alive, self.grace_s = joined, alive, grace_s
        self.waiting = 0
        name = os.environ.get("RTRAIN_STOP_SIGNAL", "SIGTERM")
        self.stop_signal = getattr(signal, name, signal.SIGTERM)
        self.interval = float(getattr(joined.config, "monitor_interval", 0.1) or 0.1)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtrain-membership",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                waiting = int(self.joined.nodes_waiting())
            except Exception:
                continue
            if waiting > 0:
                break
        else:
            return
        self.waiting = waiting
        _signal_all(dict(self.alive), self.stop_signal)
        if not self._done.wait(self.grace_s):
            _signal_all(dict(self.alive), signal.SIGKILL)

    def close(self) -> None:
        self._done.set()


def _wait(ranks: dict[int, int], envs: list[dict[str, str]], grace_s: float, name: str,
          alive: dict[int, int] | None = None, stopping=lambda: False) -> int:
    """Wait for every rank; the first that fails ends the others (SIGTERM, SIGKILL after the
    grace) and torchrun's summary is printed. `alive`: the ranks not yet ended, kept current
    here; `stopping()`: the host stopped its ranks itself (_Membership), which ends them."""
    alive = dict(ranks) if alive is None else alive
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
            if deadline is None and alive and not stopping():
                _signal_all(alive, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
    if not failures or stopping():
        return 0 if not failures else 1
    global_ranks = {i: int(env["RANK"]) for i, env in enumerate(envs)
                    if str(env.get("RANK", "")).isdigit()}
    print(summary(name, failures, global_ranks), file=sys.stderr, flush=True)
    return 1
