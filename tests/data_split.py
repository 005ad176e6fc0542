"""Run children/train_data.py uninterrupted and split into processes; compare bitwise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from bitwise import bitwise_diff
from harness import CHILDREN, child_env

SCRIPT = CHILDREN / "train_data.py"
TOTAL = 31  # 44 samples, batches of 8: six steps an epoch, the sixth of 4 samples


def run(ckpt_dir: Path, out: Path, total: int, die_at: int, *args: str,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(ckpt_dir), str(out), str(total),
                           str(die_at), *args], env=child_env(**(env or {})),
                          capture_output=True, text=True, timeout=300)


def split_vs_whole(tmp: Path, args: list[str], deaths: tuple[int, ...] = (5, 13, 17)
                   ) -> str | None:
    """None when a run killed after each step in `deaths` (each resume from the newest
    checkpoint, saved every 3 steps) ends bitwise-identical to an uninterrupted one, else
    where the two differ. The default resumes at step 3 (mid-epoch), 12 (an epoch's end) and
    15 (mid-epoch)."""
    ref = run(tmp / "ref", tmp / "ref.pt", TOTAL, 0, *args)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for die_at in deaths:
        r = run(tmp / "split", tmp / "split.pt", TOTAL, die_at, *args)
        assert r.returncode == 9, r.stderr[-3000:]
    r = run(tmp / "split", tmp / "split.pt", TOTAL, 0, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = torch.load(tmp / "ref.pt"), torch.load(tmp / "split.pt")
    assert a["step"] == b["step"] == TOTAL
    return bitwise_diff(a["model"], b["model"], "model") or bitwise_diff(a["opt"], b["opt"],
                                                                          "optimizer")
