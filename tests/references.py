"""Uninterrupted reference runs, made once and kept on disk keyed by everything they depend on.

Many end-to-end tests compare a run split by failures with the same uninterrupted run. Making
that run costs a fresh interpreter and torch's imports, far more than its steps. `cached` makes
it once for all tests and all pytest-xdist workers of a session (a file lock: the second worker
waits for the first's result), and keeps it for later sessions under .pytest_cache: the key
covers the run's own inputs and a digest of the code it runs (worker/, supervisor/,
checkpoint/, the child scripts, the torch version), so a change to any of them makes a new one.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import CHILDREN, REPO, child_env, launch_2_ranks, run_child

CACHE = REPO / ".pytest_cache" / "rtrain-references"
DONE = ".complete"  # written last: a directory without it is a run that did not finish


@functools.cache
def code_digest() -> str:
    """A digest of the code a reference run executes: the worker, supervisor and checkpoint
    packages, the test children and the installed torch."""
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for folder in ("rtrain", "worker", "supervisor", "checkpoint", "tests/children"):
        for path in sorted((REPO / folder).rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cached(name: str, inputs: dict[str, Any], make: Callable[[Path], None]) -> Path:
    """The directory of the reference run `name` with `inputs` (JSON values), made by
    `make(dir)` the first time and reused afterwards while the code it runs is unchanged. `make`
    fills an empty directory; one that raises leaves nothing behind."""
    blob = json.dumps({"name": name, "inputs": inputs, "code": code_digest()}, sort_keys=True)
    out = CACHE / f"{name}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / DONE).exists():
            return out
        work = out.with_name(out.name + f".{os.getpid()}.tmp")
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            make(work)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        (work / DONE).write_text(blob)
        os.rename(work, out)
    return out


def two_ranks(*args: str) -> Path:
    """OUT of an uninterrupted `rtrain launch --nproc-per-node 2` of children/dist_train.py
    with `args` (steps first): its final states are `OUT-rank0.pt` and `OUT-rank1.pt`. Made
    once per set of arguments and code (`cached`): a torchrun of two ranks costs tens of seconds
    on two cores, and several tests compare with the same run."""
    def make(out: Path) -> None:
        r = launch_2_ranks(out / "run", str(out / "ref"), *args)
        assert r.returncode == 0, r.stderr[-3000:]

    return cached("dist_train", {"args": list(args)}, make) / "ref"


def bitwise_run(steps: int) -> Path:
    """final.pt of an uninterrupted run of children/train_bitwise.py for `steps` steps, saving
    every 3 in the foreground (its checkpoints in ckpt/ beside it). The same entry as the mirror
    and memory tier tests' own reference of that script: one run per step count for the suite."""
    def make(out: Path) -> None:
        r = run_child([sys.executable, str(CHILDREN / "train_bitwise.py"), str(out / "ckpt"),
                       str(out / "final.pt"), str(steps), "0"], env=child_env(), timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]

    return cached("train_bitwise", {"steps": steps}, make) / "final.pt"


def rank_state(out: Path | str, rank: int) -> dict:
    """The final state children/dist_train.py wrote for `rank` of the run whose OUT is `out`."""
    import torch

    return torch.load(f"{out}-rank{rank}.pt", weights_only=False)
