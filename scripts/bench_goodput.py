"""Goodput benchmark: rtrain against the peer tools on the same job and the same SIGKILLs.

    python scripts/bench_goodput.py [--repeat 2] [--markdown] [--quick]
    scripts/install_peers.sh          # once, for ft_launcher and DLRover (their own venv)

One CPU training job (scripts/bench_children/goodput_job.py: an MLP of 10.5M parameters, AdamW,
about 110 ms a step, --steps 160, deterministic) runs under each tool, with a disk save every
--save-every 20 steps for all and an in-memory copy every step where a tool has one:

  rtrain          `rtrain launch --resume auto`, Checkpointer(every=20) with default settings
  rtrain memory=1 the same with Saving(memory=1): a snapshot every step, whatever it costs
                  (the defaults keep a snapshot's cost within 3% of the step)
  torchrun        `torchrun --max-restarts 8 --standalone --nproc-per-node 1`, torch.save
  torchrun DCP    the same launcher, torch.distributed.checkpoint.async_save
  ft_launcher     NVIDIA nvidia-resiliency-ext's launcher, torch.save   (from --peers-venv)
  DLRover         dlrover-run with its local master, Flash Checkpoint   (from --peers-venv)

Each run gets the same --kills SIGKILLs of the training process (not the launcher), at steps
drawn from --seed (one schedule a round, the same for every tool): once the process has logged
step k, the kill follows a drawn fraction of a step later. The fault-free baseline is the same
job with no checkpoint and no launcher, run in the same round. Rounds alternate the order (the
baseline and tools A B C, then C B A and the baseline), so a busy moment of the machine does not
fall on one tool. Per tool:

  goodput         the baseline's time / the tool's time with the kills (launcher start to exit),
                  each run against the baseline of its own round: on a machine whose speed
                  drifts by minutes (a plain run took 19-28 s here within an hour), the
                  baseline run next to the tool's says more than a median of all of them
  lost/kill       steps lost per kill: the last step the killed process logged minus the step
                  the next one resumed at
  kill->step      seconds from the kill to the first step the resumed process logs
  step            the median time of a step under the tool, and its ratio to the baseline's
  final state     the final parameters and optimizer state bitwise equal to the baseline's

A tool that is not installed prints as "not installed". --quick: 60 steps, 2 kills, rtrain and
torchrun only, one round (the smoke test's run).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "scripts" / "bench_children" / "goodput_job.py"
BIN = Path(sys.executable).parent
DLROVER_SOCKS = Path("/tmp/ckpt_sock")  # where DLRover's checkpoint agent puts its sockets


@dataclass
class Tool:
    key: str
    label: str
    mode: str  # goodput_job.py's MODE
    peer: bool = False  # runs from the peers venv


TOOLS = [
    Tool("rtrain", "rtrain (defaults)", "rtrain"),
    Tool("rtrain-mem", "rtrain (`Saving(memory=1)`)", "rtrain-mem"),
    Tool("torchrun", "torchrun + `torch.save`", "torchsave"),
    Tool("dcp", "torchrun + DCP `async_save`", "dcp"),
    Tool("ft", "NVIDIA `ft_launcher` + `torch.save`", "torchsave", peer=True),
    Tool("dlrover", "DLRover Flash Checkpoint", "dlrover", peer=True),
]
QUICK_TOOLS = ("rtrain", "torchrun")


@dataclass
class Run:
    """What one run of the job under one tool showed, read from the job's own log."""

    tool: str
    wall: float
    code: int | None
    starts: list[tuple[int, float, int, str]] = field(default_factory=list)  # pid, t, step, info
    steps: list[list[tuple[int, float]]] = field(default_factory=list)  # per process
    kills: list[float] = field(default_factory=list)
    digest: str | None = None
    note: str = ""
    round: int = 0  # paired with that round's baseline for goodput

    def step_times(self) -> list[float]:
        return [b[1] - a[1] for seg in self.steps for a, b in itertools.pairwise(seg)]

    def lost(self) -> list[int]:
        """Per kill: the killed process's last logged step minus the next one's start."""
        out = []
        for i in range(min(len(self.kills), len(self.starts) - 1)):
            last = self.steps[i][-1][0] if self.steps[i] else self.starts[i][2]
            out.append(last - self.starts[i + 1][2])
        return out

    def recovery(self) -> list[float]:
        """Per kill: seconds to the first step the next process logged."""
        return [self.steps[i + 1][0][1] - t for i, t in enumerate(self.kills)
                if i + 1 < len(self.steps) and self.steps[i + 1]]


def read_log(path: Path, run: Run) -> None:
    run.starts, run.steps, run.digest = [], [], None
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        f = line.split()
        if f[0] == "start":
            run.starts.append((int(f[1]), float(f[2]), int(f[3]), f[4]))
            run.steps.append([])
        elif f[0] == "step" and run.steps:
            run.steps[-1].append((int(f[1]), float(f[2])))
        elif f[0] == "done":
            run.digest = f[2]


def kill_schedule(seed: int, steps: int, kills: int) -> list[tuple[int, float]]:
    """`kills` (step, fraction of a step) pairs, one in each of `kills` equal stretches of the
    run's middle, away from the stretch's ends so that each kill finds a resumed process."""
    rng = random.Random(seed)
    lo, hi = max(2, steps // 16), steps - max(2, steps // 16)
    seg = (hi - lo) / kills
    out = []
    for i in range(kills):
        a, b = int(lo + i * seg + seg / 4), int(lo + (i + 1) * seg - seg / 4)
        out.append((rng.randint(a, max(a, b)), rng.random()))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.dir).resolve()
        self.peers = Path(args.peers_venv).resolve()
        self.step_s = 0.11  # until the first baseline measured it
        self.memory_by_default: bool | None = None

    def env(self, peer: bool) -> dict[str, str]:
        e = {k: v for k, v in os.environ.items()
             if not k.startswith(("RTRAIN_", "TORCHELASTIC", "DLROVER_", "VIRTUAL_ENV"))}
        threads = str(self.args.threads)
        e.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
        if peer:
            e["PATH"] = f"{self.peers / 'bin'}{os.pathsep}{e.get('PATH', '')}"
        return e

    def installed(self, tool: Tool) -> str | None:
        """Why `tool` cannot run here, or None."""
        if tool.key in ("torchrun", "dcp") and not (BIN / "torchrun").exists():
            return "torchrun not found beside this interpreter"
        if tool.peer:
            exe = {"ft": "ft_launcher", "dlrover": "dlrover-run"}[tool.key]
            if not (self.peers / "bin" / exe).exists():
                return "not installed"
        return None

    def job_args(self, mode: str, log: Path, ckpt: Path) -> list[str]:
        a = self.args
        return [str(JOB), mode, str(log), str(ckpt), "--steps", str(a.steps), "--batch",
                str(a.batch), "--save-every", str(a.save_every)]

    def command(self, tool: Tool | None, log: Path, work: Path) -> tuple[list[str], dict]:
        ckpt = work / "ckpt"
        if tool is None:
            return [sys.executable, *self.job_args("plain", log, ckpt)], self.env(False)
        job = self.job_args(tool.mode, log, ckpt)
        elastic = ["--max-restarts", "8", "--standalone", "--nproc-per-node", "1"]
        if tool.key in ("rtrain", "rtrain-mem"):
            return [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(work / "run"),
                    "--resume", "auto", "-q", *job], self.env(False)
        if tool.key in ("torchrun", "dcp"):
            return [str(BIN / "torchrun"), *elastic, *job], self.env(False)
        if tool.key == "ft":
            return [str(self.peers / "bin" / "ft_launcher"), *elastic, *job], self.env(True)
        env = self.env(True)
        env["DLROVER_MASTER_ADDR"] = f"127.0.0.1:{self.dlrover_port}"
        return [str(self.peers / "bin" / "dlrover-run"), "--nnodes", "1", "--nproc-per-node",
                "1", "--max-restarts", "8", *job], env

    def run(self, tool: Tool | None, schedule: list[tuple[int, float]], n: int) -> Run:
        name = tool.key if tool else "baseline"
        work = self.work / f"{n:02d}-{name}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        log = work / "job.log"
        shm_before = set(os.listdir("/dev/shm")) | {f"sock:{n}" for n in listdir(DLROVER_SOCKS)}
        run = Run(name, 0.0, None)
        t0 = time.time()  # DLRover's master counts: dlrover-run --standalone would start it
        master = self.start_dlrover_master(work) if tool and tool.key == "dlrover" else None
        cmd, env = self.command(tool, log, work)
        with open(work / "output.log", "wb") as out:  # the launcher holds its own copy
            proc = subprocess.Popen(cmd, env=env, cwd=work, stdout=out, stderr=out,
                                    start_new_session=True)
        try:
            self.watch(proc, log, run, schedule if tool else [])
        finally:
            run.wall = time.time() - t0
            run.code = proc.poll()
            if run.code is None:
                run.note = "timed out"
                stop_group(proc)
            if master is not None:
                stop_group(master)
            self.clean_shm(shm_before, tool)
        read_log(log, run)
        if run.code != 0 and not run.note:
            run.note = f"exit {run.code}: {tail(work / 'output.log')}"
        elif run.code == 0 and len(run.starts) != len(run.kills) + 1:
            # a death that was not one of the kills: lost/kill and kill->step would pair wrongly
            run.code, run.note = -1, f"{len(run.starts)} processes for {len(run.kills)} kills"
        return run

    def watch(self, proc: subprocess.Popen, log: Path, run: Run,
              schedule: list[tuple[int, float]]) -> None:
        """Wait for the launcher to exit, sending each kill of `schedule` on its way."""
        deadline = time.monotonic() + self.args.timeout
        pending = list(schedule)
        pid, last, seen = None, 0, 0
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
            if not pending or not log.exists():
                continue
            with open(log, "rb") as f:
                f.seek(seen)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            seen += end
            for line in chunk[:end].decode().splitlines():
                parts = line.split()
                if parts[0] == "start":
                    pid, last = int(parts[1]), -1  # armed only once this process logs a step
                elif parts[0] == "step":
                    last = int(parts[1])
            step, frac = pending[0]
            if pid is not None and last >= step:
                time.sleep(frac * self.step_s)
                run.kills.append(time.time())
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    run.kills.pop()
                    continue
                pending.pop(0)
                pid = None

    def start_dlrover_master(self, work: Path) -> subprocess.Popen:
        self.dlrover_port = free_port()
        py = self.peers / "bin" / "python"
        with open(work / "master.log", "wb") as out:
            master = subprocess.Popen(
                [str(py), "-m", "dlrover.python.master.main", "--platform", "local", "--port",
                 str(self.dlrover_port), "--node_num", "1", "--job_name", f"bench{os.getpid()}"],
                env=self.env(True), cwd=work, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and master.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.dlrover_port), 0.5).close()
                break
            except OSError:
                time.sleep(0.2)
        return master

    def clean_shm(self, before: set[str], tool: Tool | None) -> None:
        """DLRover's Flash Checkpoint leaves its buffers in /dev/shm and its sockets' directory
        in DLROVER_SOCKS: remove what the run added under its names (nothing of anyone else's)."""
        if tool is None or tool.key != "dlrover":
            return
        for name in listdir(DLROVER_SOCKS):
            if f"sock:{name}" not in before:
                shutil.rmtree(DLROVER_SOCKS / name, ignore_errors=True)
        for name in set(os.listdir("/dev/shm")) - before:
            path = Path("/dev/shm") / name
            if "ckpt_shm_" in name and path.is_file():  # its buffer, under the run's id or not
                path.unlink(missing_ok=True)


def listdir(path: Path) -> list[str]:
    return os.listdir(path) if path.is_dir() else []


def stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def tail(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "(no output)"


def summary(tool: Tool, runs: list[Run], base: list[Run]) -> list[str]:
    """One row: tool, goodput, lost/kill, kill->step, step time, final state."""
    med = statistics.median
    base_wall = med(r.wall for r in base)
    base_step = med(t for r in base for t in r.step_times())
    ok = [r for r in runs if r.code == 0]
    if not ok:
        return [tool.label, "failed", "", "", "", runs[0].note if runs else ""]
    paired = {r.round: r.wall for r in base if r.code == 0}
    good = [paired.get(r.round, base_wall) / r.wall for r in ok]
    goodput = f"{min(good):.2f}" + (f"-{max(good):.2f}" if len(good) > 1 else "")
    lost = [x for r in ok for x in r.lost()]
    rec = [x for r in ok for x in r.recovery()]
    steps = [t for r in ok for t in r.step_times()]
    ref = {r.digest for r in base}
    unequal = sum(r.digest not in ref for r in ok)
    final = ("bitwise" if not unequal else
             f"not bitwise in {unequal} of {len(ok)} run{'s' * (len(ok) > 1)}")
    failed = len(runs) - len(ok)
    if failed:
        final += f"; {failed} run{'s' * (failed > 1)} failed"
    return [tool.label, goodput,
            f"{statistics.mean(lost):.1f} ({', '.join(map(str, lost))})" if lost else "-",
            f"{med(rec):.2f} s" if rec else "-",
            f"{med(steps) * 1e3:.0f} ms ({med(steps) / base_step:.2f}x)" if steps else "-",
            final]


HEAD = ["tool", "goodput", "steps lost per kill", "kill -> first resumed step",
        "step time", "final state"]


def table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [HEAD, *rows]) for i in range(len(HEAD))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in [HEAD, *rows])


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=None, help="rounds (2; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the job (160; --quick 60)")
    ap.add_argument("--kills", type=int, default=None, help="SIGKILLs a run (4; --quick 2)")
    ap.add_argument("--batch", type=int, default=160, help="batch size (about 110 ms a step)")
    ap.add_argument("--save-every", type=int, default=20, help="disk save every N steps")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of every run")
    ap.add_argument("--seed", type=int, default=0, help="the kill schedule's seed")
    ap.add_argument("--tools", default=None,
                    help="comma-separated: " + ",".join(t.key for t in TOOLS))
    ap.add_argument("--quick", action="store_true",
                    help="60 steps, 2 kills, rtrain and torchrun, one round")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--dir", default="bench-out/goodput", help="the runs' work dir (removed)")
    ap.add_argument("--peers-venv", default="bench-out/peers-venv",
                    help="the venv scripts/install_peers.sh built")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (logs of each run)")
    args = ap.parse_args()
    q = args.quick
    args.repeat = args.repeat or (1 if q else 2)
    args.steps = args.steps or (60 if q else 160)
    args.kills = args.kills if args.kills is not None else (2 if q else 4)
    keys = args.tools.split(",") if args.tools else (QUICK_TOOLS if q else [t.key for t in TOOLS])
    unknown = set(keys) - {t.key for t in TOOLS}
    if unknown:
        ap.error(f"--tools: unknown {', '.join(sorted(unknown))}; choose from "
                 + ", ".join(t.key for t in TOOLS))
    args.tools = [t for t in TOOLS if t.key in keys]
    if args.steps < 4 * max(1, args.kills) or args.steps < args.save_every:
        ap.error("--steps: give at least 4 steps a kill and at least --save-every")
    return args


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the run in progress stops its launcher on the way out


def main() -> None:
    args = parse()
    signal.signal(signal.SIGTERM, _interrupted)
    bench = Bench(args)
    shutil.rmtree(bench.work, ignore_errors=True)
    tools, skipped = [], []
    for t in args.tools:
        why = bench.installed(t)
        (skipped.append((t, why)) if why else tools.append(t))
    base: list[Run] = []
    runs: dict[str, list[Run]] = {t.key: [] for t in tools}
    n = 0
    print(f"job: MLP 10.5M parameters, AdamW, batch {args.batch}, {args.steps} steps, disk save "
          f"every {args.save_every}; {args.kills} SIGKILLs a run; {args.repeat} round(s); "
          f"{os.cpu_count()} cores, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    try:
        for r in range(args.repeat):
            schedule = kill_schedule(args.seed + r, args.steps, args.kills)
            order: list[Tool | None] = [None, *tools]
            for tool in (order if r % 2 == 0 else order[::-1]):
                n += 1
                run = bench.run(tool, schedule, n)
                run.round = r
                (base if tool is None else runs[tool.key]).append(run)
                if tool is None and run.step_times():
                    bench.step_s = statistics.median(run.step_times())
                if tool and tool.key == "rtrain" and run.starts:
                    bench.memory_by_default = run.starts[0][3] == "memory-tier=on"
                print(f"  {run.tool:<10} {run.wall:6.1f} s  kills at "
                      f"{[s for s, _ in schedule] if tool else '-'}  lost {run.lost()}  "
                      f"{run.note}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(bench.work, ignore_errors=True)
    if not base or base[0].code != 0 or base[0].digest is None:
        sys.exit("the fault-free baseline did not finish: " + (base[0].note if base else ""))
    rows = [summary(t, runs[t.key], base) for t in tools if runs[t.key]]
    rows += [[t.label, why, "", "", "", ""] for t, why in skipped]
    step = statistics.median(x for r in base for x in r.step_times())
    wall = statistics.median(r.wall for r in base)
    print(f"\nfault-free baseline (no launcher, no checkpoint): {wall:.1f} s, step "
          f"{step * 1e3:.0f} ms; memory tier on by default: "
          f"{ {True: 'yes', False: 'no', None: 'not known'}[bench.memory_by_default] }")
    print(table(rows, args.markdown))


if __name__ == "__main__":
    main()
