"""Warm ranks benchmark: two DDP ranks on gloo (scripts/bench_children/warm_ranks.py), rank 1
SIGKILLed in steady state; seconds from the kill to the group's first step after the restore,

- under `rtrain launch --nproc-per-node 2 --no-backoff`, the kill once the warm standby is
  ready: the relaunch hands the group to it (proc/ranks.py, standby/rank_host.py), with the
  phases of the recovery event (teardown: from the kill to the attempt's end);
- re-running torchrun on the same script (a shell loop: `until torchrun ...; do :; done`),

in the same run, alternated, and the ratio of the medians.

usage: python scripts/bench_warm_ranks.py [--repeats 3] [--warm-kill]
Target: under rtrain at most 0.25x re-running torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KID = ROOT / "scripts" / "bench_children" / "warm_ranks.py"
STEPS = 100_000  # the first run trains until it is killed
TIMEOUT_S = 600


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    e.update(OMP_NUM_THREADS="1", **extra)
    return e


def wait_for(check, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"no {what} (exit status {proc.poll()})")
        time.sleep(0.05)


def kill_to_step(out: Path) -> float:
    return float((out / "stepping").read_text()) - float((out / "killed").read_text())


def under_rtrain(out: Path, kill_run: int) -> tuple[float, dict]:
    """(kill -> first resumed step, the recovery event's phases) with rank 1 killed in attempt
    `kill_run` (0: under torchrun; 1: in ranks the warm standby forked)."""
    out.mkdir()
    events = out / "run" / "events.jsonl"
    cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(out / "run"), "-q",
           "--no-backoff", "--nproc-per-node", "2", str(KID), str(out), str(STEPS)]
    proc = subprocess.Popen(cmd, env=env(BENCH_KILL_RUN=str(kill_run)), cwd=out,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:  # the standby that will start the next attempt is ready
        wait_for(lambda: (out / "steady").exists() and events.exists()
                 and events.read_bytes().count(b'"kind":"standby_ready"') > kill_run,
                 "steady state and standby", proc)
        (out / "kill").touch()
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0:
        raise SystemExit(f"rtrain: exit status {proc.returncode}: {err.decode()[-2000:]}")
    launches = [e for e in map(json.loads, events.read_text().splitlines())
                if e.get("kind") == "launch"]
    if len(launches) != kill_run + 2 or not all(la.get("standby") for la in launches[1:]):
        raise SystemExit("rtrain: a relaunch did not start in the warm standby")
    recovery = [e for e in map(json.loads, events.read_text().splitlines())
                if e.get("kind") == "recovery"][-1]
    return kill_to_step(out), {k[:-2]: v for k, v in recovery.items()
                               if k.endswith("_s") and k not in ("total_s", "lost_s",
                                                                 "work_lost_s", "step_time_s")}


def rerun_torchrun(out: Path) -> float:
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node=2", "--max-restarts=0", str(KID), str(out), str(STEPS)]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": out}
    proc = subprocess.Popen(cmd, env=env(BENCH_RUN="0"), **quiet)  # BENCH_KILL_RUN 0
    try:
        wait_for(lambda: (out / "steady").exists(), "steady state", proc)
        (out / "kill").touch()
        proc.wait(timeout=TIMEOUT_S)  # it fails: run it again at once, as a shell loop would
        again = subprocess.run(cmd, env=env(BENCH_RUN="1"), timeout=TIMEOUT_S, **quiet)
    finally:
        if proc.poll() is None:
            proc.kill()
    if again.returncode != 0:
        raise SystemExit(f"torchrun again: exit status {again.returncode}")
    return kill_to_step(out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-kill", action="store_true",
                   help="also kill a rank of a group the standby forked (attempt 1): the "
                        "teardown of warm ranks, which keeping the survivors would save")
    args = p.parse_args()
    warm, cold, again = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):
            cold.append(rerun_torchrun(Path(d) / f"torchrun-{i}"))
            t, phases = under_rtrain(Path(d) / f"rtrain-{i}", 0)
            warm.append(t)
            print(f"run {i}: kill -> first resumed step: rtrain {t:.2f} s, re-running "
                  f"torchrun {cold[-1]:.2f} s; rtrain's phases {fmt(phases)}", flush=True)
            if args.warm_kill:
                t, phases = under_rtrain(Path(d) / f"rtrain-warm-{i}", 1)
                again.append(t)
                print(f"run {i}: a rank of warm ranks killed -> first resumed step: {t:.2f} s; "
                      f"phases {fmt(phases)}", flush=True)
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"median of {args.repeats}: rtrain (warm ranks) {w:.2f} s, re-running torchrun "
          f"{c:.2f} s: ratio {w / c:.2f} (target: at most 0.25)")
    if again:
        print(f"median of {args.repeats}, a rank of warm ranks killed: "
              f"{statistics.median(again):.2f} s")


def fmt(phases: dict) -> str:
    return ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in phases.items() if v is not None)


if __name__ == "__main__":
    main()
