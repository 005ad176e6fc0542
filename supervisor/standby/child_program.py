"""The warm standby's own program: import the heavy modules, wait, then become the attempt.

Run by path (`python .../child_program.py FD MODE TARGET PATH0 PRELOAD ARGV0 ROLE ROOM`), never
imported by the supervisor's loop (the supervisor reads its pure helpers): it uses the standard
library only, so it starts in any interpreter the run uses, and it imports torch (and the rest of
the preload) by name, as the training script would. It is the training interpreter, so imports
here are exactly what the script would have paid for.

Protocol on the Unix socket FD (one JSON object per line):
  standby -> rtrain  {"ready": pid, "modules": [...], "files": {path: stamp}, "stamped_ns",
                     "import_s", "cuda"} or {"failed": "why"} (then it exits 1)
  rtrain -> standby  {"argv", "env", "cwd"} with two file descriptors (stdout, stderr)
  standby -> rtrain  {"started": pid} just before the script's first line, or {"failed": why}
EOF from rtrain before the hand-off: exit 0 quietly (discarded).

ROLE "zygote": after its ready message (with "zygote": true) it never becomes an attempt but
forks standbys, one per request, until EOF (then it exits 0):
  rtrain -> zygote   {"fork": 1} with one file descriptor: the new standby's socket
  zygote -> rtrain   {"forked": pid} or {"failed": why} (a thread running, CUDA initialised:
                     it exits 1 and rtrain falls back to standbys that import by themselves)
  standby -> rtrain  on its own socket: {"ready": pid, "forked": true, "ready_ns"} (what it
                     imported is its zygote's), then the hand-off above

While it imports, the preload sees what the script's imports would see in a cold start, as far
as it is known before the attempt: sys.argv and sys.orig_argv with the script (or the module's
file) but no arguments, a `__main__` whose `__file__` is the script's. Before the script runs,
everything a cold start would set is set as a cold start sets it: the environment (the
attempt's, plus what the preload's imports changed in it, as they would have changed it in a
cold start), the working directory, sys.argv and sys.orig_argv, sys.path[0], `__main__` (the
one the preload saw, with nothing of this program's in it), fds 1 and 2 (the attempt's log
pipes). Signal dispositions and the blocked mask stay as the preload left them: a cold start's
imports would have set the same. The session, process group, PDEATHSIG and cgroup were given at
spawn, as for a cold child (proc/spawn.py).

What still differs from a cold start (tests/test_standby_preload.py asserts each): a library
that reads sys.argv[1:] or sys.orig_argv at import sees no arguments (the preload ran before
they were rendered); it sees no RTRAIN_* variable at import; /proc/self/cmdline read at import
is this program's; the preloaded modules (and the standard library modules this program uses)
are in sys.modules from the script's first line, imported, like the process, before the
attempt; what they printed while importing is in standby.log; /proc/<pid>/environ is the
environment it was spawned with (so a writer it forks after the last sample is found by a later
launch through procs.json only); /proc/<pid>/cmdline holds the argv's words joined by spaces,
cut past 8 KiB. A standby forked from a zygote also shares the zygote's str hash secret (as
multiprocessing's forkserver children do): set iteration order of str differs between cold
starts, but not between standbys of one zygote; torch's, numpy's and `random`'s generators are
seeded afresh in each, as a cold start seeds them."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.machinery
import json
import os
import socket
import stat
import sys
import time
import types

# Imported by torch on first use rather than with torch: torch.optim's first optimizer imports
# torch._dynamo (hundreds of modules, seconds), so every script with an optimizer pays for it.
TORCH_LAZY = ("torch._dynamo",)
# A script that calls torch.compile imports inductor's compile path at its first compiled step
# (2.4 s on two loaded cores): paid here instead, when the script or one of its own modules
# names torch.compile. Imports only: they start no worker pool, touch no CUDA, set no variable.
TORCH_COMPILE_LAZY = ("torch._functorch.aot_autograd", "torch._inductor.codecache",
                      "torch._inductor.compile_fx")
# rtrain reads the attempt's RTRAIN_* variables at import (rtrain.worker.guards.faults arms the
# faults of one attempt), so it is never preloaded by name. A script that imports it gets the
# library's own list instead (`rtrain._WARM`: what its first Checkpointer imports, 75 ms on two
# loaded cores, paid again at each relaunch), and at the hand-off `rtrain._rebind_attempt` reads
# the attempt's variables again where a module read them at import. A script's own modules named
# `worker` or `supervisor` are the script's, and preloaded like any other.
NEVER_PRELOAD = ("rtrain",)


def _module_level_imports(path: str) -> list[str]:
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    return names


def _find(dotted: str, path: list[str] | None):
    """The spec of `dotted` without running any package's __init__ (importlib.util.find_spec
    imports the parents of a dotted name)."""
    spec = None
    for part in dotted.split("."):
        try:
            spec = importlib.machinery.PathFinder.find_spec(part, path)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        path = list(spec.submodule_search_locations or [])
    return spec


def top_imports(script: str, path0: str, depth: int = 3,
                seen_files: set[str] | None = None, never: set[str] | None = None) -> list[str]:
    """Top-level names imported at module level by the script, and by its own modules (those in
    its directory) `depth` levels down, that live outside its directory and the standard
    library, in the order written. Found without importing anything; the files read are added
    to `seen_files` (a change to one may change what is to be preloaded), the NEVER_PRELOAD
    names met to `never`."""
    std = getattr(sys, "stdlib_module_names", frozenset())
    out: list[str] = []
    seen_files = set() if seen_files is None else seen_files
    never = set() if never is None else never
    search = [path0, *(p for p in sys.path if p != path0)]  # as the script's sys.path

    def scan(path: str, left: int) -> None:
        seen_files.add(path)
        for name in dict.fromkeys(_module_level_imports(path)):
            if name in NEVER_PRELOAD:
                never.add(name)
                continue
            if name in std or name in sys.builtin_module_names or name in out:
                continue
            spec = _find(name, search)
            if spec is None:
                continue
            places = [spec.origin or "", *(spec.submodule_search_locations or [])]
            if any(p and os.path.realpath(p).startswith(path0 + os.sep) for p in places):
                origin = spec.origin or ""
                if left > 0 and origin.endswith(".py") and origin not in seen_files:
                    scan(origin, left - 1)  # the script's own module: what it imports
                continue
            out.append(name)

    scan(script, depth)
    return out


def compiles(paths: set[str]) -> bool:
    """Whether one of these files (the script and its own modules) names torch.compile."""
    for path in paths:
        try:
            with open(path, "rb") as f:
                if b"torch.compile" in f.read():
                    return True
        except OSError:
            continue
    return False


def find_main_file(mode: str, target: str, path0: str) -> str | None:
    """The file that runs as `__main__`: the script, or the module's source (not imported)."""
    if mode == "script":
        return target
    spec = _find(target, [path0, *(p for p in sys.path if p != path0)])
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def main_origin(target: str, path0: str) -> str | None:
    """The file `python -m target` runs, which is its sys.argv[0] once it runs: the module's
    source, or a package's `__main__`."""
    search = [path0, *(p for p in sys.path if p != path0)]
    spec = _find(target, search)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = _find(target + ".__main__", search)
    return spec.origin if spec is not None and spec.has_location else None


def file_stamp(path: str) -> list[int] | None:
    """What tells one version of a file from another without reading it: (device, inode, size,
    mtime, ctime), in ns. A copy that kept an old mtime (`cp -p`, `rsync -t`, `touch -d`) still
    has a new ctime, which nothing but the kernel sets, and a new inode when renamed into place.
    None: not a regular file (gone)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _is_shared_object(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(".so") or ".so." in name


def imported_files(skip: object = None) -> set[str]:
    """Every file this interpreter runs code from: each module's file in sys.modules (the
    archive of a zip-imported one), the shared libraries mapped into it (a C extension's own
    dependencies, loaded by the dynamic linker and in no module), and the interpreter itself.
    `skip`: a module to leave out (this program's own, which the attempt never runs)."""
    out: set[str] = set()
    for mod in list(sys.modules.values()):
        if mod is skip:
            continue
        path = getattr(mod, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path):
            out.add(path)
        archive = getattr(getattr(mod, "__loader__", None), "archive", None)
        if isinstance(archive, str):
            out.add(archive)
    exe = os.path.realpath(sys.executable) if sys.executable else ""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.rstrip("\n").split(None, 5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    path = fields[5]
                    if _is_shared_object(path) or path == exe:
                        out.add(path)
    except OSError:
        pass
    return out


def env_changes(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """What the preload's imports did to os.environ: each variable set to its new value, each
    removed one to None."""
    keys = {*before, *after}
    return {k: after.get(k) for k in sorted(keys) if before.get(k) != after.get(k)}


def attempt_environ(attempt_env: dict[str, str],
                    changes: dict[str, str | None]) -> dict[str, str]:
    """The environment the script starts in: the attempt's with the preload's changes applied
    again, as its imports in a cold start would have applied them. The standby was only handed
    the attempt because every variable but RTRAIN_* is as it was when the preload ran
    (standby/decide.py), so an import that set or removed one would have done the same over the
    attempt's. RTRAIN_* are the attempt's own: the preload never saw them."""
    env = dict(attempt_env)
    for key, value in changes.items():
        if key.startswith("RTRAIN_"):
            continue
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def main_module(mode: str, run_file: str | None) -> types.ModuleType:
    """The `__main__` of the attempt, made before the preload: in a cold start the script's
    imports run with the script as `__main__` (`__file__` and all), and a library that keeps
    `sys.modules["__main__"]` at import keeps the module the script then runs in."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    if mode == "script" and run_file is not None:
        main.__dict__.update(__file__=run_file, __cached__=None, __loader__=importlib.machinery
                             .SourceFileLoader("__main__", run_file))
    elif run_file is not None:
        main.__file__ = run_file  # runpy sets it, and the rest, before the module's first line
    return main


def set_cmdline(argv: list[str]) -> None:
    """Show the attempt's argv in /proc/<pid>/cmdline (ps, pgrep -f, psutil), as setproctitle
    does: the argument area is overwritten in place (rtrain padded it at spawn), the words
    joined by spaces; a title longer than the area is cut. Best effort."""
    try:
        import ctypes

        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
        room = end - start
        title = " ".join(argv).encode()[: room - 1]
        # Non-NUL last byte: the kernel reads the title up to its NUL (the setproctitle rule).
        ctypes.memmove(start, title + b"\0" + b" " * (room - len(title) - 1), room)
    except (OSError, ValueError, IndexError):
        pass


def _send(sock: socket.socket, msg: dict) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The hand-off: one JSON line and the fds sent with its first bytes; None at EOF."""
    data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
    if not data:
        return None, list(fds)
    buf = bytearray(data)
    while not buf.endswith(b"\n"):
        more = sock.recv(1 << 20)
        if not more:
            return None, list(fds)
        buf += more
    return json.loads(buf), list(fds)


def _run_script(path: str, main: types.ModuleType) -> None:
    """As `python path` runs it: in `__main__` (made by main_module), the traceback of an
    uncaught exception printed from the script's own frames, exit status 1."""
    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    _as_main(exec, code, main.__dict__)


def _as_main(run, *args) -> None:
    """Call `run(*args)`; an uncaught exception is printed with its traceback starting below
    this frame, as the interpreter prints a script's, and ends the process with status 1."""
    try:
        run(*args)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)  # the hook prints e's own traceback
        sys.exit(1)


def _warm_rtrain() -> list[str]:
    """The modules rtrain names for a warm interpreter (`rtrain._WARM`), imported."""
    rtrain = importlib.import_module("rtrain")
    names = [str(n) for n in getattr(rtrain, "_WARM", ())]
    for name in names:
        importlib.import_module(name)
    return ["rtrain", *names]


def _rebind_rtrain() -> None:
    """The attempt's environment is in place (each rank's too): what rtrain read of it at its
    import in the zygote, it reads again."""
    rebind = getattr(sys.modules.get("rtrain"), "_rebind_attempt", None)
    if rebind is not None:
        rebind()


def _rank_host() -> types.ModuleType:
    """standby/rank_host.py, beside this file, loaded by path as this program is run."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_host.py")
    spec = importlib.util.spec_from_file_location("_rtrain_rank_host", path)
    if spec is None or spec.loader is None:
        raise OSError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    fd, mode, target, path0, preload_json, argv0, role = argv[1:8]  # argv[8]: set_cmdline's room
    supervisor = os.getppid()  # rtrain: a zygote's standbys are re-parented to it
    sys.path[0] = path0  # not this file's directory: the script's, or the cwd for -m
    sock = socket.socket(fileno=int(fd))
    this = sys.modules["__main__"]  # this module, kept alive while its code runs
    t0 = time.monotonic()
    preload = json.loads(preload_json)
    main_file = find_main_file(mode, target, path0)
    scanned: set[str] = set()
    never: set[str] = set()
    if preload is None:
        preload = top_imports(main_file, path0, seen_files=scanned,
                              never=never) if main_file else []
    # What the script's imports see of how it was started, in a cold start: its name (the
    # arguments are the attempt's, not known yet) and itself as __main__.
    run_file = os.path.abspath(target) if mode == "script" else main_origin(target, path0)
    python = sys.orig_argv[0] if sys.orig_argv else sys.executable
    sys.argv = [argv0 if mode == "script" else (run_file or "-m")]
    sys.orig_argv = [python, argv0] if mode == "script" else [python, "-m", target]
    main = sys.modules["__main__"] = main_module(mode, run_file)
    env_before = dict(os.environ)
    modules = []
    for name in dict.fromkeys(preload):
        try:
            importlib.import_module(name)
        except BaseException as e:  # any import error (SystemExit too) fails the standby
            _send(sock, {"failed": f"preload of {name} failed: {type(e).__name__}: {e}"})
            sys.exit(1)
        modules.append(name)
    torch = sys.modules.get("torch")
    if torch is not None and preload_json == "null":
        lazy = TORCH_LAZY + (TORCH_COMPILE_LAZY if compiles(scanned) else ())
        for name in lazy:  # what torch would import on first use anyway
            try:
                importlib.import_module(name)
            except BaseException as e:  # the script would fail the same way when it uses it
                _send(sock, {"failed": f"preload of {name} failed: {type(e).__name__}: {e}"})
                sys.exit(1)
            modules.append(name)
        if "rtrain" in never:
            try:
                modules += _warm_rtrain()
            except BaseException as e:  # the script's own import would fail the same way
                _send(sock, {"failed": f"preload of rtrain failed: {type(e).__name__}: {e}"})
                sys.exit(1)
    changed_env = env_changes(env_before, dict(os.environ))
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    paths = imported_files(skip=this) | scanned
    if main_file:
        paths.add(main_file)
    stamped_ns = time.time_ns()
    files = {p: s for p, s in ((p, file_stamp(p)) for p in sorted(paths)) if s is not None}
    _send(sock, {"ready": os.getpid(), "modules": modules, "files": files,
                 "stamped_ns": stamped_ns, "import_s": round(time.monotonic() - t0, 3),
                 "cuda": cuda, "zygote": role == "zygote"})
    if cuda:
        sys.exit(1)  # rtrain refuses it; never hand a CUDA context to a new attempt
    if role == "zygote":
        sock = _serve_as_zygote(sock, supervisor)  # returns in a forked standby only
    _become_attempt(sock, mode, target, main, changed_env)


# ------------------------------------------------------------------ the zygote

PR_SET_PDEATHSIG = 1
REPARENT_WAIT_S = 2.0
"""How long a forked standby waits to be re-parented to rtrain (its parent exits at once)."""


def _threads() -> int:
    """Threads running in this process now (the kernel's count: a native library's threads
    too, which `threading` does not know of)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _serve_as_zygote(sock: socket.socket, supervisor: int) -> socket.socket:
    """Fork a standby for each request from rtrain: `{"fork": 1}` with the standby's own
    socket (SCM_RIGHTS), answered `{"forked": pid}` or `{"failed": why}`. Returns only in a
    forked standby, with its socket; the zygote itself exits when rtrain closes its socket."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 4096, 1)
        except OSError:
            sys.exit(0)
        if not data:
            sys.exit(0)  # the launch ended, or rtrain replaced this zygote
        if len(fds) != 1:
            for f in fds:
                os.close(f)
            _send(sock, {"failed": "a fork request without the standby's socket"})
            continue
        why = _unsafe_to_fork()
        if why is not None:
            os.close(fds[0])
            _send(sock, {"failed": why})
            sys.exit(1)  # rtrain falls back to standbys that import by themselves
        pid = _fork_standby(sock, fds[0], supervisor)
        if pid == 0:  # the standby: ready at once
            standby = socket.socket(fileno=fds[0])
            _send(standby, {"ready": os.getpid(), "forked": True, "ready_ns": time.time_ns()})
            return standby
        os.close(fds[0])
        _send(sock, {"forked": pid} if pid > 0 else {"failed": "the forked standby died"})


def _unsafe_to_fork() -> str | None:
    """Why forking this process now could hand a standby a broken state: a thread holds
    locks that the child would find taken forever; a CUDA context does not survive a fork."""
    threads = _threads()
    if threads > 1 and _threads_after_a_probe_fork() > 1:
        return (f"{threads} threads run in the zygote after its imports: forking it is unsafe, "
                "so each standby imports by itself")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialised in the zygote"
    return None


def _threads_after_a_probe_fork() -> int:
    """The threads left once this process has forked a child that exits at once. A library
    that stops its own threads before a fork (pthread_atfork: numpy's OpenBLAS thread server,
    started at `import numpy` unless OMP_NUM_THREADS=1) leaves none, and starts them again only
    when it is next used, which a zygote never does; a thread that goes on across a fork (a
    Python thread, a library's own worker) is still there."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _threads()


def _fork_standby(sock: socket.socket, standby_fd: int, supervisor: int) -> int:
    """Double fork: the standby is the grandchild, re-parented to rtrain (a child subreaper)
    when its parent exits at once, so rtrain waits for it as for a cold child. Returns the
    standby's pid in the zygote (-1: it died before it reported), 0 in the standby."""
    sys.stdout.flush()  # nothing buffered here is printed twice
    sys.stderr.flush()
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(r)
            if os.fork() != 0:
                os._exit(0)
            sock.close()  # the zygote's: never the standby's to read
            os.setsid()  # its own session and group, as a cold child (pgid == pid)
            os.write(w, str(os.getpid()).encode())  # once its group exists: rtrain kills it
            os.close(w)
            _after_fork(supervisor)
            return 0
        except BaseException:
            os._exit(1)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):
        data += chunk
    os.close(r)
    os.waitpid(middle, 0)  # once it is reaped, the standby is rtrain's child
    return int(data) if data else -1


def _after_fork(supervisor: int) -> None:
    """In the forked standby: what a cold child gets at its spawn that a fork does not give.
    PDEATHSIG is tied to the parent, so it is set once rtrain is the parent (set earlier, the
    middle process's exit would fire it); the random state a cold start draws afresh at import
    is drawn afresh (`random` does it itself at fork, torch's and numpy's generators do not)."""
    import ctypes

    deadline = time.monotonic() + REPARENT_WAIT_S
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            os._exit(1)  # rtrain is gone, or is not a subreaper: it could not wait for us
        time.sleep(0.0005)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL
    if os.getppid() != supervisor:  # rtrain died before prctl took effect
        os._exit(1)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _become_attempt(sock: socket.socket, mode: str, target: str, main: types.ModuleType,
                    changed_env: dict[str, str | None]) -> None:
    """Wait for the hand-off, then run the attempt in this process (never returns)."""
    try:
        msg, fds = _receive(sock)
    except (OSError, ValueError):
        msg, fds = None, []
    if msg is None or len(fds) != 2:
        sys.exit(0)  # discarded
    try:
        os.chdir(msg["cwd"])
        env = attempt_environ(msg["env"], changed_env)
        os.environ.clear()
        os.environ.update(env)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds:
            os.close(f)
        child_argv = msg["argv"]
        sys.orig_argv = list(child_argv)
        set_cmdline(child_argv)
        rank_host = _rank_host() if "ranks" in msg else None
        _send(sock, {"started": os.getpid()})
    except (OSError, KeyError, TypeError, ValueError) as e:
        try:
            _send(sock, {"failed": f"hand-off failed: {e}"})
        except OSError:
            pass
        sys.exit(1)
    sock.close()
    if rank_host is not None:  # several ranks: this process hosts them, each runs the script
        child_argv = rank_host.host(msg["ranks"], set_cmdline)
    _rebind_rtrain()
    if mode == "script":
        sys.argv = list(child_argv[1:])
        _run_script(os.path.abspath(target), main)
    else:
        import runpy

        sys.argv = ["-m", *child_argv[3:]]
        # What `python -m` calls: the module runs in sys.modules["__main__"]'s namespace,
        # main_module's, not this program's.
        _as_main(runpy._run_module_as_main, target, True)


if __name__ == "__main__":
    main(sys.argv)
