"""Recovery benchmark: a real crash -> the first training step of the resumed process.

    python scripts/bench_recovery.py [--repeat 3] [--settle 3]

One training script (scripts/bench_children/recover_train.py: imports torch, builds a model,
restores its checkpoint, trains; raises once when told) run under
  rtrain launch              (warm standby, the default)
  rtrain launch --no-standby (each attempt a new interpreter)
  torchrun --max-restarts 1  (0.1 s monitor interval)
in turn, --repeat times each; medians. The crash is armed once the run is in its steady state:
it has saved a checkpoint and, under rtrain with the standby, the standby is ready (it is
started 5 s into an attempt and imports meanwhile), then --settle seconds more for every
launcher alike. Target: with the standby <= 0.25x torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_children" / "recover_train.py"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("RTRAIN_", "TORCHELASTIC"))}
    e.update(OMP_NUM_THREADS="1")
    return e


def gap(marks: Path) -> float:
    seen = dict(line.split()[:2] for line in marks.read_text().splitlines())
    return float(seen["resumed"]) - float(seen["crash"])


def phases(work: Path) -> tuple[float, float, float] | None:
    """Under rtrain: crash -> the exit recorded, -> the next launch, -> its first step."""
    seen = dict(line.split()[:2] for line in (work / "marks").read_text().splitlines())
    events = work / "run" / "events.jsonl"
    if not events.exists():
        return None
    times: dict[str, float] = {}
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "exit" and "exit" not in times:
            times["exit"] = e["time"]
        if e["kind"] == "launch" and e.get("attempt") == 1:
            times["launch"] = e["time"]
    crash, resumed = float(seen["crash"]), float(seen["resumed"])
    return times["exit"] - crash, times["launch"] - times["exit"], resumed - times["launch"]


def _steady(work: Path, mode: str) -> bool:
    if not (work / "ckpt.pt").exists():
        return False
    if mode != "standby":
        return True
    events = work / "run" / "events.jsonl"
    return events.exists() and '"standby_ready"' in events.read_text()


parts: dict[str, list] = {"standby": [], "cold": [], "torchrun": []}


def one(tmp: Path, mode: str, settle: float) -> float:
    work = Path(tempfile.mkdtemp(dir=tmp, prefix=mode + "-"))
    marks, arm = work / "marks", work / "arm"
    args = [str(SCRIPT), str(work), str(marks), str(arm)]
    if mode == "torchrun":
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--nproc-per-node", "1", "--max-restarts", "1",
               "--monitor-interval", "0.1", *args]
    else:
        cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(work / "run"),
               "-q", "--no-backoff", *(["--no-standby"] if mode == "cold" else []), *args]
    log = work / "output.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env(), cwd=work, stdout=out, stderr=out)
        deadline = time.monotonic() + 300
        while not _steady(work, mode):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"{mode}: no steady state\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(settle)
        arm.touch()
        code = proc.wait(timeout=300)
    if code != 0:
        sys.exit(f"{mode}: exit {code}\n{log.read_text()[-3000:]}")
    parts[mode].append(phases(work))
    return gap(marks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0, metavar="SECONDS",
                    help="wait this long in the steady state before the crash")
    args = ap.parse_args()
    if not (Path(sys.executable).parent / "torchrun").exists():
        sys.exit("torchrun not found beside this interpreter (it comes with torch)")
    tmp = Path(tempfile.mkdtemp(prefix="rtrain-bench-recovery-"))
    runs: dict[str, list[float]] = {"standby": [], "cold": [], "torchrun": []}
    try:
        for _ in range(args.repeat):
            for mode in runs:  # in turn, so a busy moment of the machine hits all three
                runs[mode].append(one(tmp, mode, args.settle))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    print(f"crash -> first resumed step, {args.repeat} runs each, medians; "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'launcher':<40}{'median':>9}  {'runs':<28}  vs torchrun")
    names = {"standby": "rtrain (warm standby, default)", "cold": "rtrain --no-standby",
             "torchrun": "torchrun --max-restarts 1"}
    for mode, values in runs.items():
        each = " ".join(f"{v:.2f}" for v in values)
        print(f"{names[mode]:<40}{med[mode]:8.2f}s  {each:<28}  "
              f"{med[mode] / med['torchrun']:.2f}x")
    for mode in ("standby", "cold"):
        split = [statistics.median(p[i] for p in parts[mode]) for i in range(3)]
        print(f"  {names[mode]}: crash -> exit recorded {split[0]:.2f} s, -> next attempt "
              f"started {split[1]:.3f} s, -> first step {split[2]:.2f} s")
    ratio = med["standby"] / med["torchrun"]
    print(f"target: standby <= 0.25x torchrun: {'met' if ratio <= 0.25 else 'NOT met'} "
          f"({ratio:.2f}x)")


if __name__ == "__main__":
    main()
