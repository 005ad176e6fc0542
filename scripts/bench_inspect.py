"""Benchmark: `rtrain inspect` (or `rtrain prune`) over 100 checkpoints, wall time including
interpreter start-up.

Target (issue 2): <= 0.3 s, and torch is never imported. Run from the repository root:

    python scripts/bench_inspect.py [--checkpoints 100] [--repeat 7] [--verify quick]
    python scripts/bench_inspect.py --command prune   # prune --keep 3 --dry-run: the listing
                                                      # plus full verification of the kept set
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.safetensors_io import TensorBlob

TARGET_S = 0.3


def make_checkpoints(root: Path, count: int) -> None:
    """Checkpoints shaped like real ones: a model and an optimizer file with a few dozen
    tensors each, state.json, metrics and settings in the manifest."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((64, 64)).astype(np.float32) for _ in range(40)]
    for i in range(count):
        step = (i + 1) * 100
        p = PendingCheckpoint(root, step, fsync=False)
        for fname in ("model.safetensors", "optimizer.safetensors"):
            p.write_tensors(fname, [TensorBlob(f"layer{j}.weight", "F32", a.shape,
                                               memoryview(a)) for j, a in enumerate(arrays)])
        p.write_json("state.json", {"step": step, "sampler": {"position": step * 32}})
        p.commit({"epoch": i // 10, "samples_seen": step * 32, "fingerprint": "0" * 32,
                  "environment": {"python": "3.11", "torch": "2.13.0"},
                  "settings": {"batch_size": 32, "grad_accum": 1},
                  "metrics": {"loss": 1.0 / step, "lr": 1e-3}, "info": {}})


def run_inspect(ckpt_dir: Path, level: str, *extra: str,
                command: str = "inspect") -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # prune with --dry-run: the same verification and planning, nothing removed between runs.
    args = ["--keep", "3", "--dry-run"] if command == "prune" else []
    return subprocess.run([sys.executable, *extra, "-m", "rtrain", command, str(ckpt_dir),
                           "--verify", level, *args], env=env, capture_output=True, text=True,
                          check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoints", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--verify", choices=["quick", "full"], default="quick")
    ap.add_argument("--command", choices=["inspect", "prune"], default="inspect")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        make_checkpoints(root, args.checkpoints)
        traced = run_inspect(root, args.verify, "-X", "importtime", command=args.command)
        torch_lines = [ln for ln in traced.stderr.splitlines()
                       if ln.rsplit("|", 1)[-1].strip().split(".")[0] == "torch"]
        run_inspect(root, args.verify, command=args.command)  # warm page cache and .pyc files
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            run_inspect(root, args.verify, command=args.command)
            times.append(time.perf_counter() - t0)
    best, median = min(times), statistics.median(times)
    print(f"rtrain {args.command} --verify {args.verify}, {args.checkpoints} checkpoints, "
          f"{args.repeat} runs: median {median:.3f} s, best {best:.3f} s "
          f"(target {TARGET_S} s: median is {median / TARGET_S:.2f}x the target)")
    print("torch imported: " + ("YES, " + torch_lines[0].strip() if torch_lines else "no"))
    return 0 if median <= TARGET_S and not torch_lines else 1


if __name__ == "__main__":
    sys.exit(main())
