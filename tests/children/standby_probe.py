"""Records what a started script can see of how it was started, as JSON into argv[1]: the
standby tests compare a cold child with one started in the warm standby."""

import ctypes
import faulthandler
import json
import os
import random
import signal
import stat
import sys
from pathlib import Path

import torch

main = sys.modules["__main__"]
libc = ctypes.CDLL(None, use_errno=True)
pdeathsig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(pdeathsig), 0, 0, 0)  # PR_GET_PDEATHSIG


def handler_name(h):
    if h is None:
        return None
    if isinstance(h, int):
        return signal.Handlers(h).name
    return getattr(h, "__name__", repr(h))


def fd_kind(fd):
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    target = os.readlink(f"/proc/self/fd/{fd}")
    kind = "fifo" if stat.S_ISFIFO(mode) else "chr" if stat.S_ISCHR(mode) else "other"
    return f"{kind}:{target if kind == 'chr' else ''}"


# What a training script does first: its optimizer imports torch._dynamo, which sets
# TORCHINDUCTOR_CACHE_DIR at import (the standby imported it long before).
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

with open(f"/proc/{os.getpid()}/status") as f:
    status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
import psutil  # noqa: E402

record = {
    # Drawn per process at import (torch seeds its default generator from the OS): different
    # in every process, so compared apart.
    "seeds": [torch.initial_seed(), random.getrandbits(64)],
    "str_hash": hash("rtrain"),  # the interpreter's hash secret, drawn at its start
    "cmdline": psutil.Process().cmdline(),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "name": __name__,
    "file": __file__,
    "main_is_this": main.__dict__ is globals(),
    "main_attrs": sorted(k for k in vars(main) if k.startswith("__")),
    "main_names": sorted(vars(main)),
    "main_loader": type(main.__loader__).__name__,
    "main_spec": [getattr(main.__spec__, "name", None), getattr(main.__spec__, "origin", None)],
    "main_cached": main.__cached__,
    "path0": sys.path[0],
    "cwd": os.getcwd(),
    "environ": dict(os.environ),
    "signals": {s.name: handler_name(signal.getsignal(s)) for s in signal.valid_signals()
                if isinstance(s, signal.Signals)},
    "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "sig_ignored": status.get("SigIgn"),
    "sig_blocked": status.get("SigBlk"),
    "sig_caught": status.get("SigCgt"),
    "pdeathsig": pdeathsig.value,
    "pgid_is_pid": os.getpgid(0) == os.getpid(),
    "sid_is_pid": os.getsid(0) == os.getpid(),
    "ppid": os.getppid(),
    "cgroup": Path("/proc/self/cgroup").read_text(),
    "faulthandler": faulthandler.is_enabled(),
    "fds": {fd: fd_kind(fd) for fd in (0, 1, 2)},
    "stdout": [sys.stdout.isatty(), sys.stdout.seekable(), sys.stdout.line_buffering,
               sys.stdout.write_through, sys.stdout.encoding],
    "stderr": [sys.stderr.isatty(), sys.stderr.seekable(), sys.stderr.encoding],
    "flags": list(sys.flags),
    "cuda_initialized": torch.cuda.is_initialized(),
    "uid": os.getuid(),
    "umask": os.umask(0o022),
    "nice": os.nice(0),
    "autogroup_nice": Path("/proc/self/autogroup").read_text().split()[-1]
    if Path("/proc/self/autogroup").exists() else None,
}
with open(sys.argv[1], "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
print("probe out", flush=True)
print("probe err", file=sys.stderr, flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "raise":
    raise ValueError("probe failure")
