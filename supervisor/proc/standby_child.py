"""The warm standby's own program: import the heavy modules, wait, then become the attempt.

Run by path (`python .../standby_child.py FD MODE TARGET PATH0 PRELOAD`), never imported by the
supervisor: it uses the standard library only, so it starts in any interpreter the run uses, and
it imports torch (and the rest of the preload) by name, as the training script would. It is the
training interpreter, so imports here are exactly what the script would have paid for.

Protocol on the Unix socket FD (one JSON object per line):
  standby -> rtrain  {"ready": pid, "modules": [...], "files": {path: stamp}, "stamped_ns",
                     "import_s", "cuda"} or {"failed": "why"} (then it exits 1)
  rtrain -> standby  {"argv", "env", "cwd"} with two file descriptors (stdout, stderr)
  standby -> rtrain  {"started": pid} just before the script's first line, or {"failed": why}
EOF from rtrain before the hand-off: exit 0 quietly (discarded).

Before the script runs, everything a cold start would set is set as a cold start sets it: the
environment (cleared, then the attempt's), the working directory, sys.argv and sys.orig_argv,
sys.path[0], a fresh `__main__`, fds 1 and 2 (the attempt's log pipes), signal dispositions and
the blocked mask as the interpreter had them at its start. The session, process group,
PDEATHSIG and cgroup were given at spawn, as for a cold child (proc/spawn.py).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import json
import os
import signal
import socket
import stat
import sys
import time

# Imported by torch on first use rather than with torch: torch.optim's first optimizer imports
# torch._dynamo (hundreds of modules, seconds), so every script with an optimizer pays for it.
TORCH_LAZY = ("torch._dynamo",)
# rtrain's own packages read the attempt's RTRAIN_* variables at import (worker.faults arms
# the faults of one attempt): importing them before the hand-off would bind the wrong attempt.
NEVER_PRELOAD = ("supervisor", "worker")


def _dispositions() -> dict[int, object]:
    out = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if handler is not None:  # None: set outside Python, left alone
            out[sig] = handler
    return out


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
                seen_files: set[str] | None = None) -> list[str]:
    """Top-level names imported at module level by the script, and by its own modules (those in
    its directory) `depth` levels down, that live outside its directory and the standard
    library, in the order written. Found without importing anything; the files read are added
    to `seen_files` (a change to one may change what is to be preloaded)."""
    std = getattr(sys, "stdlib_module_names", frozenset())
    out: list[str] = []
    seen_files = set() if seen_files is None else seen_files
    search = [path0, *(p for p in sys.path if p != path0)]  # as the script's sys.path

    def scan(path: str, left: int) -> None:
        seen_files.add(path)
        for name in dict.fromkeys(_module_level_imports(path)):
            if (name in std or name in sys.builtin_module_names or name in NEVER_PRELOAD
                    or name in out):
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


def find_main_file(mode: str, target: str, path0: str) -> str | None:
    """The file that runs as `__main__`: the script, or the module's source (not imported)."""
    if mode == "script":
        return target
    spec = _find(target, [path0, *(p for p in sys.path if p != path0)])
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


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


def _run_script(path: str) -> None:
    """As `python path` runs it: a fresh `__main__`, the traceback of an uncaught exception
    printed from the script's own frames, exit status 1."""
    import builtins
    import importlib.machinery
    import types

    with open(path, "rb") as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                         __annotations__={},
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
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


def main(argv: list[str]) -> None:
    # First, before any import can change them: what a cold interpreter starts with.
    dispositions = _dispositions()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    fd, mode, target, path0, preload_json = argv[1:6]  # argv[6]: room for set_cmdline
    sys.path[0] = path0  # not this file's directory: the script's, or the cwd for -m
    sock = socket.socket(fileno=int(fd))
    keep = sys.modules["__main__"]  # this module, while its code runs
    t0 = time.monotonic()
    preload = json.loads(preload_json)
    main_file = find_main_file(mode, target, path0)
    scanned: set[str] = set()
    if preload is None:
        preload = top_imports(main_file, path0, seen_files=scanned) if main_file else []
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
        for name in TORCH_LAZY:  # what torch would import on first use anyway
            try:
                importlib.import_module(name)
            except BaseException as e:  # the script would fail the same way when it uses it
                _send(sock, {"failed": f"preload of {name} failed: {type(e).__name__}: {e}"})
                sys.exit(1)
            modules.append(name)
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    paths = imported_files(skip=keep) | scanned
    if main_file:
        paths.add(main_file)
    stamped_ns = time.time_ns()
    files = {p: s for p, s in ((p, file_stamp(p)) for p in sorted(paths)) if s is not None}
    _send(sock, {"ready": os.getpid(), "modules": modules, "files": files,
                 "stamped_ns": stamped_ns, "import_s": round(time.monotonic() - t0, 3),
                 "cuda": cuda})
    if cuda:
        sys.exit(1)  # rtrain refuses it; never hand a CUDA context to a new attempt
    try:
        msg, fds = _receive(sock)
    except (OSError, ValueError):
        msg, fds = None, []
    if msg is None or len(fds) != 2:
        sys.exit(0)  # discarded
    try:
        os.chdir(msg["cwd"])
        os.environ.clear()
        os.environ.update(msg["env"])
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for f in fds:
            os.close(f)
        child_argv = msg["argv"]
        sys.orig_argv = list(child_argv)
        for sig, handler in dispositions.items():
            if signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        set_cmdline(child_argv)
        _send(sock, {"started": os.getpid()})
    except (OSError, KeyError, TypeError, ValueError) as e:
        try:
            _send(sock, {"failed": f"hand-off failed: {e}"})
        except OSError:
            pass
        sys.exit(1)
    sock.close()
    if mode == "script":
        sys.argv = list(child_argv[1:])
        _run_script(os.path.abspath(target))
    else:
        import runpy

        sys.argv = ["-m", *child_argv[3:]]
        _as_main(runpy._run_module_as_main, target, True)  # what `python -m` calls


if __name__ == "__main__":
    main(sys.argv)
