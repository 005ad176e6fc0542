"""Recovery benchmark: a real crash -> the first training step of the resumed process.

    python scripts/bench_recovery.py [--repeat 3] [--settle 3] [--kill-after SECONDS]

One training script (scripts/bench_children/recover_train.py: imports torch, builds a model,
restores its checkpoint, trains; raises once when told) run under
  rtrain launch              (warm standby, the default)
  rtrain launch --no-standby (each attempt a new interpreter)
  torchrun --max-restarts 1  (0.1 s monitor interval)
in turn, --repeat times each; medians. The crash is armed once the run is in its steady state:
it has saved a checkpoint and, under rtrain with the standby, the standby is ready (it is
started 5 s into an attempt and imports meanwhile), then --settle seconds more for every
launcher alike. Target: with the standby <= 0.25x torchrun.

--kill-after S: the crash is followed by a SIGKILL of the relaunched process S seconds after
it started (a failure soon after a relaunch, before a standby that imports by itself is ready
again), and what is measured is that kill -> the first resumed step. Under rtrain with the
standby it also prints when each attempt's standby was ready, from the attempt's start
(`standby_ready`): the first attempt's imports, then the ones after a relaunch.
"""

from __future__ import annotations

import argparse
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
SCRIPT = ROOT / "scripts" / "bench_children" / "recover_train.py"


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("RTRAIN_", "TORCHELASTIC"))}
    e.update(OMP_NUM_THREADS="1")
    return e


def _marks(marks: Path) -> list[tuple[str, float, str]]:
    return [(w[0], float(w[1]), w[2] if len(w) > 2 else "")
            for w in (line.split() for line in marks.read_text().splitlines()) if len(w) >= 2]


def _failure(marks: Path) -> tuple[float, float]:
    """The measured failure (the kill, else the crash) and the first resumed step after it."""
    seen = _marks(marks)
    at = max(t for k, t, _ in seen if k in ("crash", "kill"))
    return at, min(t for k, t, _ in seen if k == "resumed" and t > at)


def gap(marks: Path) -> float:
    at, resumed = _failure(marks)
    return resumed - at


def _events(work: Path) -> list[dict]:
    events = work / "run" / "events.jsonl"
    return [json.loads(line) for line in events.read_text().splitlines()] if events.exists() \
        else []


def phases(work: Path, attempt: int) -> tuple[float, float, float] | None:
    """Under rtrain: the failure -> the exit recorded, -> the next launch, -> its first step."""
    events = _events(work)
    if not events:
        return None
    at, resumed = _failure(work / "marks")
    times: dict[str, float] = {}
    for e in events:
        if e["kind"] == "exit" and e.get("attempt") == attempt - 1 and "exit" not in times:
            times["exit"] = e["time"]
        if e["kind"] == "launch" and e.get("attempt") == attempt:
            times["launch"] = e["time"]
    return times["exit"] - at, times["launch"] - times["exit"], resumed - times["launch"]


def ready_after_start(work: Path) -> dict[int, float | None]:
    """Each attempt's standby: seconds from the attempt's start until it was ready (None:
    none was ready while the attempt ran)."""
    events = _events(work)
    out: dict[int, float | None] = {}
    started = {e["attempt"]: e["time"] for e in events if e["kind"] == "launch"}
    for attempt, t0 in started.items():
        ready = [e for e in events if e["kind"] == "standby_ready" and e["attempt"] == attempt]
        if not ready:
            out[attempt] = None
        elif ready[0].get("since_start_s") is not None:
            out[attempt] = ready[0]["since_start_s"]
        else:  # recorded when the supervisor read it: at most a sample later
            out[attempt] = ready[0]["time"] - t0
    return out


def _kill_soon(work: Path, proc: subprocess.Popen, after: float, mode: str) -> None:
    """Once the relaunched process started (after the crash), SIGKILL it `after` s later."""
    marks = work / "marks"
    deadline = time.monotonic() + 300
    while True:
        seen = _marks(marks)
        crash = [t for k, t, _ in seen if k == "crash"]
        starts = [(t, pid) for k, t, pid in seen if k == "start" and crash and t > crash[0]]
        if starts:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit(f"{mode}: no relaunch after the crash")
        time.sleep(0.01)
    t0, pid = starts[0]
    time.sleep(max(0.0, t0 + after - time.time()))
    (work / "hold").unlink()
    with open(marks, "a") as f:
        f.write(f"kill {time.time()!r}\n")
    os.kill(int(pid), signal.SIGKILL)


def _steady(work: Path, mode: str) -> bool:
    if not (work / "ckpt.pt").exists():
        return False
    if mode != "standby":
        return True
    events = work / "run" / "events.jsonl"
    return events.exists() and '"standby_ready"' in events.read_text()


parts: dict[str, list] = {"standby": [], "cold": [], "torchrun": []}
ready: list[dict[int, float | None]] = []


def one(tmp: Path, mode: str, settle: float, kill_after: float | None) -> float:
    work = Path(tempfile.mkdtemp(dir=tmp, prefix=mode + "-"))
    marks, arm = work / "marks", work / "arm"
    args = [str(SCRIPT), str(work), str(marks), str(arm)]
    if kill_after is not None:
        (work / "hold").touch()
    if mode == "torchrun":
        torchrun = Path(sys.executable).parent / "torchrun"
        cmd = [str(torchrun), "--nproc-per-node", "1", "--max-restarts",
               "1" if kill_after is None else "2", "--monitor-interval", "0.1", *args]
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
        if kill_after is not None:
            _kill_soon(work, proc, kill_after, mode)
        code = proc.wait(timeout=300)
    if code != 0:
        sys.exit(f"{mode}: exit {code}\n{log.read_text()[-3000:]}")
    parts[mode].append(phases(work, 1 if kill_after is None else 2))
    if mode == "standby":
        ready.append(ready_after_start(work))
    return gap(marks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--settle", type=float, default=3.0, metavar="SECONDS",
                    help="wait this long in the steady state before the crash")
    ap.add_argument("--kill-after", type=float, default=None, metavar="SECONDS",
                    help="measure a SIGKILL this long after the relaunch that follows the "
                         "crash, instead of the crash")
    ap.add_argument("--launchers", default="standby,cold,torchrun",
                    help="which to run, comma-separated (default: all three)")
    args = ap.parse_args()
    chosen = args.launchers.split(",")
    if not (Path(sys.executable).parent / "torchrun").exists():
        sys.exit("torchrun not found beside this interpreter (it comes with torch)")
    tmp = Path(tempfile.mkdtemp(prefix="rtrain-bench-recovery-"))
    runs: dict[str, list[float]] = {m: [] for m in ("standby", "cold", "torchrun")
                                    if m in chosen}
    try:
        for _ in range(args.repeat):
            for mode in runs:  # in turn, so a busy moment of the machine hits all three
                runs[mode].append(one(tmp, mode, args.settle, args.kill_after))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    what = ("crash" if args.kill_after is None
            else f"SIGKILL {args.kill_after:g} s after a relaunch")
    print(f"{what} -> first resumed step, {args.repeat} runs each, medians; "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'launcher':<40}{'median':>9}  {'runs':<28}  vs torchrun")
    names = {"standby": "rtrain (warm standby, default)", "cold": "rtrain --no-standby",
             "torchrun": f"torchrun --max-restarts {1 if args.kill_after is None else 2}"}
    for mode, values in runs.items():
        each = " ".join(f"{v:.2f}" for v in values)
        vs = f"{med[mode] / med['torchrun']:.2f}x" if "torchrun" in med else "-"
        print(f"{names[mode]:<40}{med[mode]:8.2f}s  {each:<28}  {vs}")
    for mode in ("standby", "cold"):
        if mode not in runs:
            continue
        split = [statistics.median(p[i] for p in parts[mode]) for i in range(3)]
        print(f"  {names[mode]}: {what} -> exit recorded {split[0]:.2f} s, -> next attempt "
              f"started {split[1]:.3f} s, -> first step {split[2]:.2f} s")
    for attempt in sorted({a for r in ready for a in r}):
        each = [r.get(attempt) for r in ready]
        print(f"  standby of attempt {attempt} ready after its start: "
              + " ".join("none" if v is None else f"{v:.2f}s" for v in each))
    if "standby" not in med or "torchrun" not in med:
        return
    ratio = med["standby"] / med["torchrun"]
    print(f"target: standby <= 0.25x torchrun: {'met' if ratio <= 0.25 else 'NOT met'} "
          f"({ratio:.2f}x)")


if __name__ == "__main__":
    main()
