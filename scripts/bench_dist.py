"""Distributed benchmark: save and restore of one total state by 1 rank and by 2 ranks
(sharded, DCP under the commit protocol), and the time from a kill of one rank to a relaunched,
stepping job under `rtrain launch --nproc-per-node 2`.

usage: python scripts/bench_dist.py [--mib 128] [--repeats 3]
Target: the 2-rank save is no slower per byte than the 1-rank save.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIDS = ROOT / "scripts" / "bench_children"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    e.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return e


def save_restore(world: int, mib: int, repeats: int, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           "--standalone", str(KIDS / "dist_ckpt.py"), str(tmp / f"ck{world}"), str(mib),
           str(repeats)]
    r = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("{")][-1])


def relaunch(tmp: Path) -> tuple[float, float, float]:
    """(kill -> attempt's exit seen, kill -> relaunch, kill -> first step of the new attempt)"""
    out = tmp / "relaunch"
    out.mkdir()
    cmd = [sys.executable, "-m", "supervisor", "launch", "--run-dir", str(out / "run"), "-q",
           "--no-backoff", "--nproc-per-node", "2", str(KIDS / "dist_relaunch.py"), str(out),
           "25", "60"]
    r = subprocess.run(cmd, env=env(), cwd=out, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    killed = float((out / "killed").read_text())
    from supervisor.records.events import read_events

    evs = read_events(out / "run" / "events.jsonl")
    exit_t = next(e["time"] for e in evs if e["kind"] == "exit")
    launch_t = [e["time"] for e in evs if e["kind"] == "launch"][1]
    return exit_t - killed, launch_t - killed, float((out / "stepping").read_text()) - killed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        one = save_restore(1, args.mib, args.repeats, tmp)
        two = save_restore(2, args.mib, args.repeats, tmp)
        for r in (one, two):
            print(f"world {r['world']}: {r['bytes'] / 2**20:.1f} MiB  save {r['save_s']:.3f} s "
                  f"({r['bytes'] / r['save_s'] / 2**20:.0f} MiB/s)  restore "
                  f"{r['restore_s']:.3f} s ({r['bytes'] / r['restore_s'] / 2**20:.0f} MiB/s)")
        ratio_save = (two["save_s"] / two["bytes"]) / (one["save_s"] / one["bytes"])
        ratio_load = (two["restore_s"] / two["bytes"]) / (one["restore_s"] / one["bytes"])
        print(f"per-byte time, 2 ranks / 1 rank: save {ratio_save:.2f}, restore "
              f"{ratio_load:.2f} (target: save <= 1.0)")
        t0 = time.monotonic()
        seen, relaunched, stepping = relaunch(tmp)
        print(f"kill of rank 1 -> relaunched group stepping: {stepping:.2f} s (exit seen "
              f"{seen:.2f} s, relaunched {relaunched:.2f} s, the rest is torchrun and torch "
              f"start-up and the restore; whole run {time.monotonic() - t0:.1f} s)")


if __name__ == "__main__":
    main()
