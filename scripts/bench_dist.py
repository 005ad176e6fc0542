"""Distributed benchmark: save and restore of one total state by 1 rank and by 2 ranks
(sharded, DCP under the commit protocol), the time from a kill of one rank to a relaunched,
stepping job under `rtrain launch --nproc-per-node 2`, and the time from the loss of a whole
node (two `rtrain launch --nnodes` supervisors on this machine, one rank each) to the group
stepping again: with a replacement node started at once (`--nnodes 2`), and without one
(`--nnodes 1:2`, the survivor alone after the rendezvous' last call).

usage: python scripts/bench_dist.py [--mib 128] [--repeats 3] [--skip-save]
Target: the 2-rank save is no slower per byte than the 1-rank save.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIDS = ROOT / "scripts" / "bench_children"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    e.update(OMP_NUM_THREADS="1")
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
    cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(out / "run"), "-q",
           "--no-backoff", "--nproc-per-node", "2", str(KIDS / "dist_relaunch.py"), str(out),
           "25", "60"]
    r = subprocess.run(cmd, env=env(), cwd=out, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    killed = float((out / "killed").read_text())
    from rtrain.supervisor.records.events import read_events

    evs = read_events(out / "run" / "events.jsonl")
    exit_t = next(e["time"] for e in evs if e["kind"] == "exit")
    launch_t = [e["time"] for e in evs if e["kind"] == "launch"][1]
    return exit_t - killed, launch_t - killed, float((out / "stepping").read_text()) - killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lose_node(sup: subprocess.Popen) -> None:
    """SIGKILL a node's supervisor and every process below it, at once."""
    import psutil

    procs = [psutil.Process(sup.pid), *psutil.Process(sup.pid).children(recursive=True)]
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sup.wait()
    psutil.wait_procs(procs, timeout=10)


def node_loss(tmp: Path, nnodes: str, replace: bool) -> dict[str, float]:
    """Seconds from the SIGKILL of node b (after checkpoint-20) to: the survivor's supervisor
    seeing its attempt end (detection), its relaunched ranks starting, i.e. the rendezvous
    complete (relaunch + rendezvous), and the group's first step after the restore (the ranks'
    start-up, process group and restore)."""
    out = tmp / f"nodes-{nnodes.replace(':', '-')}"
    out.mkdir()
    port = free_port()

    def node(name: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(out / f"run-{name}"),
               "--ckpt-dir", str(out / "ck"), "-q", "--no-backoff", "--nproc-per-node", "1",
               "--nnodes", nnodes, "--rdzv-endpoint", f"127.0.0.1:{port}",
               str(KIDS / "dist_node.py"), str(out), name, "400"]
        return subprocess.Popen(cmd, env=env(), cwd=out, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    a, b = node("a"), node("b")
    spare = None
    try:
        deadline = time.time() + 300
        while not (out / "ck" / "checkpoint-20" / "manifest.json").exists():
            if time.time() > deadline or a.poll() is not None:
                raise SystemExit(f"{nnodes}: no checkpoint-20 (see {out})")
            time.sleep(0.05)
        killed = time.time()
        lose_node(b)
        if replace:
            spare = node("b2")  # a new machine: an empty run dir, the shared checkpoint dir
        if a.wait(timeout=600) != 0:
            raise SystemExit(f"{nnodes}: node a failed (see {out})")
    finally:
        for p in (a, b, spare):
            if p is not None and p.poll() is None:
                lose_node(p)
    from rtrain.supervisor.records.events import read_events

    evs = read_events(out / "run-a" / "events.jsonl")
    exit_t = next(e["time"] for e in evs if e["kind"] == "exit")
    started = float((out / "a-1-start").read_text())
    stepping = float((out / "a-1-stepping").read_text())
    return {"detection": exit_t - killed, "rendezvous": started - exit_t,
            "restore": stepping - started, "total": stepping - killed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-save", action="store_true", help="only the kill and node-loss times")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.skip_save:
            save_and_restore(tmp, args.mib, args.repeats)
        t0 = time.monotonic()
        seen, relaunched, stepping = relaunch(tmp)
        print(f"kill of rank 1 -> relaunched group stepping: {stepping:.2f} s (exit seen "
              f"{seen:.2f} s, relaunched {relaunched:.2f} s, the rest is torchrun and torch "
              f"start-up and the restore; whole run {time.monotonic() - t0:.1f} s)")
        for nnodes, replace, what in (("2", True, "replacement started at once"),
                                      ("1:2", False, "no replacement: the survivor alone")):
            t = node_loss(tmp, nnodes, replace)
            print(f"loss of node b, --nnodes {nnodes} ({what}) -> group stepping: "
                  f"{t['total']:.2f} s = detection {t['detection']:.2f} s + relaunch and "
                  f"rendezvous {t['rendezvous']:.2f} s + start-up and restore "
                  f"{t['restore']:.2f} s")


def save_and_restore(tmp: Path, mib: int, repeats: int) -> None:
    one = save_restore(1, mib, repeats, tmp)
    two = save_restore(2, mib, repeats, tmp)
    for r in (one, two):
        print(f"world {r['world']}: {r['bytes'] / 2**20:.1f} MiB  save {r['save_s']:.3f} s "
              f"({r['bytes'] / r['save_s'] / 2**20:.0f} MiB/s)  restore "
              f"{r['restore_s']:.3f} s ({r['bytes'] / r['restore_s'] / 2**20:.0f} MiB/s)")
    ratio_save = (two["save_s"] / two["bytes"]) / (one["save_s"] / one["bytes"])
    ratio_load = (two["restore_s"] / two["bytes"]) / (one["restore_s"] / one["bytes"])
    print(f"per-byte time, 2 ranks / 1 rank: save {ratio_save:.2f}, restore "
          f"{ratio_load:.2f} (target: save <= 1.0)")


if __name__ == "__main__":
    main()
