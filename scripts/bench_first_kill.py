"""The first failure of a launch: the zygote started beside the first attempt, or at its heartbeat.

    python scripts/bench_first_kill.py [--repeat 3] [--kill-at 1,2,3] [--steps 12]

The goodput benchmark's job (scripts/bench_children/goodput_job.py: an MLP of 10.5M parameters,
AdamW, about 110 ms a step on two cores) under `rtrain launch --resume auto --no-backoff`, with
the launch's zygote started

  idle core     at the first attempt's first sample where a core's worth of CPU went unused
                since it started (the default, `standby_idle_cores` 0.75), else at its first
                heartbeat
  always        at the first attempt's first sample, idle core or not (`standby_idle_cores` 0)
  heartbeat     at the first attempt's first heartbeat, as before (`standby_idle_cores` set
                past the core count)

in turn, --repeat times each. Two measures:

  first step    launch -> the first attempt's first step, and its first --steps steps' median
                time, with no kill: what the zygote importing beside them costs
  kill -> step  a SIGKILL of the first attempt --kill-at seconds after the launch started
                (importing, building its model, or at its first steps), to the first step of
                the resumed attempt, and whether that attempt started in a standby forked from
                a zygote

--no-backoff takes the relaunch's backoff out, so what is left is the hand-off. The tuning
constant is set the way the test suite sets constants (tests/tuned.py with a tuning file).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "scripts" / "bench_children" / "goodput_job.py"
TUNED = ROOT / "tests" / "tuned.py"
MODES = {"idle core": 0.75, "always": 0.0, "heartbeat": 1e9}


def env(tuning: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RTRAIN_", "TORCHELASTIC"))}
    e.update(OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", PYTHONUNBUFFERED="1",
             TUNING_FILE=str(tuning))
    return e


def lines(log: Path) -> list[list[str]]:
    return [w.split() for w in log.read_text().splitlines()] if log.exists() else []


def events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def one(tmp: Path, mode: str, steps: int, kill_at: float | None) -> dict:
    work = Path(tempfile.mkdtemp(dir=tmp))
    tuning = work / "tuning.json"
    tuning.write_text(json.dumps({"standby_idle_cores": MODES[mode]}))
    log, run = work / "job.log", work / "run"
    cmd = [sys.executable, str(TUNED), "launch", "--run-dir", str(run), "--resume", "auto",
           "-q", "--no-backoff", str(JOB), "rtrain", str(log), str(work / "ckpt"),
           "--steps", str(steps), "--save-every", "1000"]
    t0 = time.time()
    with open(work / "output.log", "wb") as out:
        proc = subprocess.Popen(cmd, env=env(tuning), cwd=work, stdout=out, stderr=out)
        killed = None
        if kill_at is not None:
            time.sleep(max(0.0, t0 + kill_at - time.time()))
            first = [e for e in events(run) if e["kind"] == "launch" and e["attempt"] == 0]
            if not first:
                proc.kill()
                sys.exit(f"{mode}: no attempt started in {kill_at:g} s")
            killed = time.time()
            os.kill(first[0]["pid"], signal.SIGKILL)
        code = proc.wait(timeout=600)
    if code != 0:
        sys.exit(f"{mode}: exit {code}\n{(work / 'output.log').read_text()[-3000:]}")
    seen = lines(log)
    step_t = [float(w[2]) for w in seen if w[0] == "step"]
    out: dict = {}
    if killed is None:
        out["first_step"] = step_t[0] - t0
        out["step"] = statistics.median(b - a for a, b in itertools.pairwise(step_t))
    else:
        out["kill_to_step"] = min(t for t in step_t if t > killed) - killed
        evs = events(run)
        second = [e for e in evs if e["kind"] == "launch" and e["attempt"] == 1]
        ready = [e for e in evs if e["kind"] == "standby_ready" and e["attempt"] == 0]
        out["forked"] = bool(second and second[0].get("standby") and ready
                             and ready[0].get("zygote")
                             and ready[0]["pid"] == second[0]["pid"])
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kill-at", default="1,2,3", help="seconds after the launch, comma-separated")
    ap.add_argument("--steps", type=int, default=12, help="steps of each run")
    args = ap.parse_args()
    kills = [float(k) for k in args.kill_at.split(",") if k]
    tmp = Path(tempfile.mkdtemp(prefix="rtrain-bench-first-kill-"))
    res: dict[tuple[str, float | None], list[dict]] = {}
    load0 = os.getloadavg()[0]
    try:
        for r in range(args.repeat):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            for kill_at in [None, *kills]:
                for mode in order:  # alternating, so a busy moment falls on both
                    res.setdefault((mode, kill_at), []).append(
                        one(tmp, mode, args.steps, kill_at))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{os.cpu_count()} cores, load average {load0:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {args.repeat} runs each, medians")
    base = {}
    for mode in MODES:
        runs = res[(mode, None)]
        first = statistics.median(x["first_step"] for x in runs)
        step = statistics.median(x["step"] for x in runs)
        base[mode] = first
        each = " ".join(f"{x['first_step']:.2f}" for x in runs)
        print(f"zygote {mode:<13} launch -> first step {first:5.2f} s ({each}), "
              f"step {step * 1e3:4.0f} ms")
    for mode in ("idle core", "always"):
        print(f"  first step {mode} / heartbeat: {base[mode] / base['heartbeat']:.3f}")
    for kill_at in kills:
        med = {}
        for mode in MODES:
            runs = res[(mode, kill_at)]
            med[mode] = statistics.median(x["kill_to_step"] for x in runs)
            forked = sum(x["forked"] for x in runs)
            each = " ".join(f"{x['kill_to_step']:.2f}" for x in runs)
            print(f"kill {kill_at:g} s after launch, zygote {mode:<13} kill -> first resumed "
                  f"step {med[mode]:5.2f} s ({each}), in a forked standby {forked}/{len(runs)}")
        for mode in ("idle core", "always"):
            print(f"  kill -> step {mode} / heartbeat: {med[mode] / med['heartbeat']:.2f}")


if __name__ == "__main__":
    main()
