"""Compiled-model restart benchmark: a crash -> the first resumed step of a `torch.compile`d
model, under rtrain and under torchrun, on the same script, measured in the same run.

    python scripts/bench_compile_restart.py [--repeat 3] [--layers 6] [--width 256]

The script (tests/children/train_compiled.py: an MLP under torch.compile, rtrain.Checkpointer,
signed checkpoints) runs
- on the same node: crash -> first resumed step, as scripts/bench_recovery.py measures it:
    rtrain launch               (the run dir's compile cache, the warm standby)
    torchrun --max-restarts 1   (inductor's default cache in $TMPDIR, which its restarts share)
- on a fresh node (a Slurm requeue elsewhere, a new pod): an empty $TMPDIR and a new run dir,
  resuming from a copy of the checkpoint dir the same-node rtrain run left; measured from the
  launcher's start to the first resumed step (the scheduler's delay before it is the same for
  both):
    rtrain launch --ckpt-dir SHARED   (loads the checkpoint's compile cache: signed)
    torchrun --max-restarts 0         (compiles cold)
torchrun runs the script with Saving(compile_cache=False): what torch.compile gives a script by
itself. Each launcher gets its own new $TMPDIR. Targets: same node <= 0.6x torchrun, fresh
node <= 0.5x torchrun. Medians of --repeat runs.
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
SCRIPT = ROOT / "tests" / "children" / "train_compiled.py"
KEY = "bench-compile-restart"
TOTAL = "1000000"  # never reached: every run ends at its first resumed step


def env(tmp: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("RTRAIN_", "TORCHELASTIC", "TORCHINDUCTOR_", "TRITON_"))}
    tmp.mkdir(parents=True, exist_ok=True)
    e.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp),
             RTRAIN_SIGNING_KEY=KEY)
    return e


def marks(path: Path) -> dict[str, float]:
    seen: dict[str, float] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        what, when = line.split()[:2]
        seen.setdefault(what, float(when))
    return seen


def rtrain(run_dir: Path, *more: str) -> list[str]:
    return [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(run_dir), "-q",
            "--no-backoff", *more]


def torchrun(restarts: int) -> list[str]:
    return [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "1",
            "--max-restarts", str(restarts), "--monitor-interval", "0.1"]


def _run(cmd: list[str], work: Path, ready, arm: Path | None, settle: float) -> None:
    log = work / "output.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env(work / "tmp"), cwd=work, stdout=out, stderr=out)
        deadline = time.monotonic() + 600
        while arm is not None and not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                sys.exit(f"{work.name}: no steady state\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        if arm is not None:
            time.sleep(settle)
            arm.touch()
        code = proc.wait(timeout=600)
    if code != 0:
        sys.exit(f"{work.name}: exit {code}\n{log.read_text()[-3000:]}")


def same_node(tmp: Path, mode: str, model: list[str], settle: float) -> tuple[float, Path]:
    work = Path(tempfile.mkdtemp(dir=tmp, prefix=f"same-{mode}-"))
    arm, mk = work / "arm", work / "marks"
    ckpt = work / "run" / "checkpoints" if mode == "rtrain" else work / "ckpt"
    args = [str(SCRIPT), "{ckpt_dir}" if mode == "rtrain" else str(ckpt), str(work / "out"),
            TOTAL, "--arm", str(arm), "--marks", str(mk), "--stop-after-resume",
            "--sleep", "0.01", *model]
    cmd = (rtrain(work / "run", *args) if mode == "rtrain"
           else [*torchrun(1), *args, "--no-cache"])

    def ready() -> bool:
        if not ckpt.exists() or not any(ckpt.glob("checkpoint-*")):
            return False
        ev = work / "run" / "events.jsonl"
        return mode != "rtrain" or (ev.exists() and '"standby_ready"' in ev.read_text())

    _run(cmd, work, ready, arm, settle)
    m = marks(mk)
    return m["resumed"] - m["crash"], ckpt


def fresh_node(tmp: Path, mode: str, shared: Path, model: list[str]) -> tuple[float, str]:
    work = Path(tempfile.mkdtemp(dir=tmp, prefix=f"fresh-{mode}-"))
    ckpt, mk = work / "ckpt", work / "marks"
    shutil.copytree(shared, ckpt, symlinks=True)  # the shared dir, or what the mirror gave back
    args = [str(SCRIPT), str(ckpt), str(work / "out"), TOTAL, "--marks", str(mk),
            "--stop-after-resume", *model]
    cmd = (rtrain(work / "run", "--ckpt-dir", str(ckpt), *args) if mode == "rtrain"
           else [*torchrun(0), *args, "--no-cache"])
    began = time.time()
    _run(cmd, work, None, None, 0.0)
    loaded = ""
    ev = work / "run" / "events.jsonl"
    if ev.exists():
        for line in ev.read_text().splitlines():
            e = json.loads(line)
            if e["kind"] == "compile_cache":
                loaded = f"{e['outcome']}: {e['detail']}"
    return marks(mk)["resumed"] - began, loaded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--settle", type=float, default=2.0, metavar="SECONDS",
                    help="wait this long in the steady state before the crash")
    args = ap.parse_args()
    if not (Path(sys.executable).parent / "torchrun").exists():
        sys.exit("torchrun not found beside this interpreter (it comes with torch)")
    model = ["--layers", str(args.layers), "--width", str(args.width)]
    tmp = Path(tempfile.mkdtemp(prefix="rtrain-bench-compile-"))
    runs: dict[str, list[float]] = {k: [] for k in ("same-rtrain", "same-torchrun",
                                                    "fresh-rtrain", "fresh-torchrun")}
    notes: list[str] = []
    try:
        for _ in range(args.repeat):  # in turn, so a busy moment of the machine hits all
            gap, shared = same_node(tmp, "rtrain", model, args.settle)
            runs["same-rtrain"].append(gap)
            runs["same-torchrun"].append(same_node(tmp, "torchrun", model, args.settle)[0])
            for mode in ("rtrain", "torchrun"):
                took, note = fresh_node(tmp, mode, shared, model)
                runs[f"fresh-{mode}"].append(took)
                if note:
                    notes.append(note)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    print(f"compiled MLP ({args.layers} x {args.width}), torch.compile on CPU; "
          f"{args.repeat} runs each, medians; {os.cpu_count()} cores; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'case':<58}{'median':>9}  {'runs':<24}  vs torchrun")
    names = {"same-rtrain": "same node: crash -> first step, rtrain launch",
             "same-torchrun": "same node: crash -> first step, torchrun --max-restarts 1",
             "fresh-rtrain": "fresh node: start -> first step, rtrain launch",
             "fresh-torchrun": "fresh node: start -> first step, torchrun"}
    for key, values in runs.items():
        base = med[key.split("-")[0] + "-torchrun"]
        print(f"{names[key]:<58}{med[key]:8.2f}s  {' '.join(f'{v:.2f}' for v in values):<24}"
              f"  {med[key] / base:.2f}x")
    if notes:
        print(f"  rtrain on the fresh node, compile cache: {notes[-1]}")
    for where, target in (("same", 0.6), ("fresh", 0.5)):
        ratio = med[f"{where}-rtrain"] / med[f"{where}-torchrun"]
        print(f"target: {where} node <= {target}x torchrun: "
              f"{'met' if ratio <= target else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
