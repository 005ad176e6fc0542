"""Run children/train_data.py uninterrupted and split into processes; compare bitwise.

Each run is a fresh Python process, and starting one (torch's imports) costs far more than its
steps: the uninterrupted run of each set of arguments is made once for the whole suite
(`whole`, kept in the reference cache) and tests that compare several configurations with one
reference hand it in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from bitwise import bitwise_diff
from harness import CHILDREN, child_env, run_child
from references import cached

SCRIPT = CHILDREN / "train_data.py"
# 44 samples, batches of 8: six steps an epoch, the sixth of 4 samples. The shortest run that
# still crosses an epoch's end after the last resume (at step 12, the second epoch's end): 19.
TOTAL = 19


def run(ckpt_dir: Path, out: Path, total: int, die_at: int, *args: str,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # One run takes a few seconds; a minute is a hang (run_child shows where).
    return run_child([sys.executable, str(SCRIPT), str(ckpt_dir), str(out), str(total),
                      str(die_at), *args], env=child_env(**(env or {})), timeout=60)


def whole(args: list[str]) -> Path:
    """The final state of an uninterrupted run with `args` (a file in the suite's reference
    cache, made once per set of arguments and code: references.cached)."""
    def make(out: Path) -> None:
        r = run(out / "ref", out / "ref.pt", TOTAL, 0, *args)
        assert r.returncode == 0, r.stderr[-3000:]

    return cached("data", {"args": args, "total": TOTAL}, make) / "ref.pt"


def split_vs_whole(tmp: Path, args: list[str], deaths: tuple[int, ...] = (5, 13),
                   reference: Path | None = None,
                   runs: list[subprocess.CompletedProcess] | None = None) -> str | None:
    """None when a run killed after each step in `deaths` (each resume from the newest
    checkpoint, saved every 3 steps) ends bitwise-identical to an uninterrupted one, else
    where the two differ. The default resumes at step 3 (mid-epoch) and at 12 (an epoch's end).
    `reference`: the uninterrupted run's final state when already run (see `whole`). `runs`
    collects the split run's processes, for what they said."""
    ref = reference or whole(args)
    done = [] if runs is None else runs
    for die_at in deaths:
        done.append(run(tmp / "split", tmp / "split.pt", TOTAL, die_at, *args))
        assert done[-1].returncode == 9, done[-1].stderr[-3000:]
    done.append(run(tmp / "split", tmp / "split.pt", TOTAL, 0, *args))
    assert done[-1].returncode == 0, done[-1].stderr[-3000:]
    a, b = torch.load(ref), torch.load(tmp / "split.pt")
    assert a["step"] == b["step"] == TOTAL
    return bitwise_diff(a["model"], b["model"], "model") or bitwise_diff(a["opt"], b["opt"],
                                                                          "optimizer")
