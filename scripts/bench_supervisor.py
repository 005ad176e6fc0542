"""Supervisor benchmark: rtrain against baselines measured in the same run.

    python scripts/bench_supervisor.py [--repeat 20]

  child-death detection   child's last instruction -> watch() returns     (target <= 10 ms median)
  relaunch overhead       old child's exit -> new child's first line, no backoff, no checkpoint
                          (target <= 30 ms median), beside torchrun --max-restarts and a bare spawn
  time to first step      rtrain launch vs the same script run bare        (target <= 1.1x)
  supervisor CPU          while watching a busy child, steady state        (target <= 1% of a core)
  hang detection          last heartbeat -> hang detected, 1 s timeout     (target <= timeout + 1 s)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KIDS = ROOT / "scripts" / "bench_children"

from rtrain.supervisor.config import Config, HangConfig  # noqa: E402
from rtrain.supervisor.proc.heartbeat import HangPolicy, HeartbeatReceiver  # noqa: E402
from rtrain.supervisor.proc.spawn import ChildSpec, spawn  # noqa: E402
from rtrain.supervisor.proc.watch import WatchConfig, watch  # noqa: E402


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    e.update(OMP_NUM_THREADS="1", **extra)
    return e


def detection(tmp: Path, n: int) -> list[float]:
    out = []
    code = "import os, sys, time; open(sys.argv[1], 'w').write(repr(time.monotonic())); os._exit(3)"
    for i in range(n):
        stamp = tmp / f"det{i}"
        child = spawn(ChildSpec(argv=[sys.executable, "-c", code, str(stamp)], env=env(),
                                cwd=tmp, attempt_dir=tmp / f"det-a{i}"))
        ret = watch(child, replace(WatchConfig.from_config(Config()), sweep_confirm_s=0.5))
        done = time.monotonic()
        child.close()
        assert ret.seen.returncode == 3
        out.append(done - float(stamp.read_text()))
    return out


def relaunch_gaps(log: Path) -> list[float]:
    starts, exits = {}, {}
    for line in log.read_text().split("\n"):
        if line:
            what, attempt, t = line.split()
            (starts if what == "start" else exits)[int(attempt)] = float(t)
    return [starts[a + 1] - exits[a] for a in sorted(exits) if a + 1 in starts]


def relaunch_rtrain(tmp: Path, n: int) -> list[float]:
    run = tmp / "relaunch-run"
    (tmp / "rtrain.toml").write_text(
        f"[restart]\nmax_restarts = {n + 5}\n[restart.budgets]\n"
        f"crash = {n + 5}\n[backoff]\nenabled = false\n")
    # Every attempt crashes before a checkpoint: the crash-loop rule (a constant) is turned
    # off the way tests do it (tests/tuned.py).
    tuning = (tmp / "tuning.json")
    tuning.write_text('{"restart": {"crash_loop_k": 0}}')
    log = tmp / "relaunch-rtrain.log"
    subprocess.run([sys.executable, str(ROOT / "tests" / "tuned.py"), "launch", "--run-dir",
                    str(run), "-q", str(KIDS / "relaunch_child.py"), str(log), str(n)],
                   env=env(), cwd=tmp, check=True, capture_output=True)
    (tmp / "rtrain.toml").unlink()
    tuning.unlink()
    return relaunch_gaps(log)


def relaunch_torchrun(tmp: Path, n: int) -> list[float] | None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        return None
    log = tmp / "relaunch-torchrun.log"
    subprocess.run([torchrun, "--nproc-per-node", "1", f"--max-restarts={n}",
                    "--monitor-interval", "0.1", str(KIDS / "relaunch_child.py"), str(log),
                    str(n)], env=env(), cwd=tmp, capture_output=True)
    return relaunch_gaps(log)


def bare_spawn(tmp: Path, n: int) -> list[float]:
    log = tmp / "bare.log"
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        subprocess.run([sys.executable, str(KIDS / "relaunch_child.py"), str(log), "0"],
                       env=env())
        out.append(float(log.read_text().split()[-1]) - t0)
        log.unlink()
    return out


def first_step(tmp: Path, n: int) -> tuple[float, float]:
    bare, sup = [], []
    for i in range(n):
        mark = tmp / f"fs{i}"
        t0 = time.time()
        subprocess.run([sys.executable, str(KIDS / "first_step.py"), str(mark)], env=env(),
                       check=True)
        bare.append(float(mark.read_text()) - t0)
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "rtrain", "launch", "--run-dir",
                        str(tmp / f"fs-run{i}"), "-q", str(KIDS / "first_step.py"), str(mark)],
                       env=env(), cwd=tmp, check=True, capture_output=True)
        sup.append(float(mark.read_text()) - t0)
    return statistics.median(bare), statistics.median(sup)


def supervisor_cpu(tmp: Path, seconds: float = 8.0) -> float:
    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "rtrain", "launch", "--run-dir",
                             str(tmp / "cpu-run"), "-q", str(KIDS / "busy.py"), str(seconds)],
                            env=env(), cwd=tmp, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    p = psutil.Process(proc.pid)
    time.sleep(2.0)  # past start-up (imports) and into the steady state
    c0, t0 = sum(p.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds - 3.0)
    c1, t1 = sum(p.cpu_times()[:2]), time.monotonic()
    proc.wait()
    return (c1 - c0) / (t1 - t0)


def hang_latency(tmp: Path, n: int) -> list[float]:
    out = []
    for i in range(n):
        mark = tmp / f"hang{i}"
        with HeartbeatReceiver() as hb:
            child = spawn(ChildSpec(
                argv=[sys.executable, str(KIDS / "busy.py"), "2", str(mark)],
                env=env(RTRAIN_HEARTBEAT=hb.name, RTRAIN_STATUS=str(tmp / f"hang-a{i}")),
                cwd=tmp, attempt_dir=tmp / f"hang-a{i}"))
            hang = HangPolicy.from_config(HangConfig(floor_s=1.0, multiple=2.0, warmup_steps=3))
            cfg = replace(WatchConfig.from_config(Config(sample_interval_s=0.5)), hang=hang,
                          hang_grace_s=1.0, dump_timeout_s=3.0)
            ret = watch(child, cfg, heartbeats=hb)
            child.close()
        assert ret.seen.hang, ret.seen
        out.append(ret.seen.hang_at - float(mark.read_text()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    n = args.repeat
    tmp = Path(tempfile.mkdtemp(prefix="rtrain-bench-"))
    try:
        det = detection(tmp, n)
        rl = relaunch_rtrain(tmp, n)
        tr = relaunch_torchrun(tmp, min(n, 10))
        bare = bare_spawn(tmp, n)
        fs_bare, fs_sup = first_step(tmp, max(3, n // 5))
        cpu = supervisor_cpu(tmp)
        hang = hang_latency(tmp, 3)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    ms = 1000.0
    print(f"{n} runs each (first step: {max(3, n // 5)}, hang: 3), medians; {os.cpu_count()} cores")
    print(f"{'measure':<46}{'value':>12}  target")
    print(f"{'child-death detection':<46}{med(det) * ms:9.1f} ms  <= 10 ms")
    print(f"{'relaunch: exit -> first line, rtrain':<46}{med(rl) * ms:9.1f} ms  <= 30 ms")
    if tr:
        print(f"{'relaunch: exit -> first line, torchrun':<46}{med(tr) * ms:9.1f} ms  (baseline)")
    else:
        print(f"{'relaunch: torchrun':<46}{'n/a':>12}  (torchrun not found)")
    print(f"{'bare spawn -> first line':<46}{med(bare) * ms:9.1f} ms  (baseline)")
    print(f"{'time to first step, bare':<46}{fs_bare:10.2f} s  (baseline)")
    print(f"{'time to first step, under rtrain':<46}{fs_sup:10.2f} s  "
          f"{fs_sup / fs_bare:.2f}x (<= 1.10x)")
    print(f"{'supervisor CPU, busy child (steady state)':<46}{cpu * 100:10.2f} %  <= 1 %")
    print(f"{'hang detection, 1 s timeout':<46}{med(hang):10.2f} s  <= 2.00 s")


if __name__ == "__main__":
    main()
