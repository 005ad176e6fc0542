"""Inject faults at random into real supervised training runs for N minutes; print a summary.

    python scripts/chaos.py --minutes 15 [--seed S] [--jobs J] [--dir DIR] [--kinds K,K]
                            [--cadence auto|N] [--memory auto|N]

Each episode is one supervised run of tests/children/chaos_train.py (a small deterministic training
loop that logs every step it executes) from a fresh run directory, with a random plan of faults, one
per attempt, then a clean attempt that finishes. It saves every 4 steps, or with `--cadence auto` at
the interval worker/saving/cadence.py chooses from the measured save stall and the run's failures;
`--memory` adds the memory tier (`Saving(memory=...)`: snapshots in shared memory every N steps, or
"auto", which rtrain commits when the process dies). Kinds:

    kill            SIGKILL the training child at a random moment (start-up or training)
    kill_in_save    SIGKILL it between two files of a checkpoint save (RTRAIN_FAULTS)
    crash           an uncaught exception at a random step, after its optimizer step
                    (RTRAIN_FAULTS)
    crash_forward   an uncaught exception in the forward of a random step, before its optimizer
                    step: the worker saves the last completed step at the failure
    oom             a CUDA-style out-of-memory error after the optimizer step (RTRAIN_FAULTS):
                    rtrain degrades
    oom_forward     the same in the forward, before the optimizer step (saved at the failure)
    hang            the step loop stops after a step's optimizer step; rtrain detects it,
                    dumps stacks, relaunches
    hang_forward    the step loop stops in the forward, before the optimizer step: rtrain asks
                    the hung process to save the last completed step, then relaunches from it
    nonfinite       NaN losses until the guard ends the attempt: rollback with the lr cut
    corrupt_newest  flip a byte of the newest checkpoint, then crash
    preempt         SIGTERM to rtrain: it must exit 75; then the same command again
    supervisor_kill SIGKILL to rtrain (the child must die with it); then the same command again

Per episode it checks: rtrain finished (exit 0); the final weights and optimizer state are
bitwise-identical to an uninterrupted run (episodes with an oom or nonfinite fault change the
batch split or the learning rate by design: for those the surviving steps must instead have seen
every sample of every epoch exactly once, at the same effective batch); every checkpoint loaded
verified at `full` just before it was loaded; no process of the run is left.

"Steps lost" are step executions beyond one per step (work redone after a failure), "bytes
rewritten" the checkpoint bytes saved again for a step already committed before, and "committed
bytes lost" the bytes of committed checkpoints that failed verification without a
corrupt_newest fault having damaged them on purpose (must be 0).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chaos_util import (  # noqa: E402
    Tail,
    check_exactly_once,
    final_state_diff,
    kill_child,
    leftovers,
    reference,
    rtrain_cmd,
    starts,
    step_log,
    surviving,
    wait_gone,
    write_config,
)
from harness import child_env, events  # noqa: E402

from rtrain.supervisor.records.runstate import load_state  # noqa: E402

KINDS = ("kill", "kill_in_save", "crash", "crash_forward", "oom", "oom_forward", "hang",
         "hang_forward", "nonfinite", "corrupt_newest", "preempt", "supervisor_kill")
# hang costs the timeout plus rtrain's 15 s grace for a hung child: drawn less often.
WEIGHTS = {"kill": 4, "kill_in_save": 3, "crash": 2, "crash_forward": 2, "oom": 1,
           "oom_forward": 1, "hang": 0.6, "hang_forward": 0.6, "nonfinite": 1,
           "corrupt_newest": 2, "preempt": 2, "supervisor_kill": 2}
OOMS = {"oom", "oom_forward"}  # each halves the batch: at most two per episode (8 -> 2)
ENV_FAULT = {"kill_in_save", "crash", "crash_forward", "oom", "oom_forward", "hang",
             "hang_forward", "nonfinite", "corrupt_newest"}
EXTERNAL = {"kill", "preempt", "supervisor_kill"}
NOT_BITWISE = {"oom", "oom_forward", "nonfinite"}  # change the batch split or the lr on purpose
SETTINGS = {"steps": 100, "save_every": 4, "step_sleep": 0.01, "samples": 64, "batch_size": 8,
            "grad_accum": 1, "lr": 0.01}
HANG_S = 3.0
# A hang a few steps after a relaunch comes before the step timeout is learned: it is caught by
# the start-up allowance ([hang] timeout_s, 30 min by default), shortened here.
STARTUP_HANG_S = 20.0
EPISODE_LIMIT_S = 900.0
EXPECT = {"kill": "crash", "kill_in_save": "crash", "crash": "crash", "crash_forward": "crash",
          "oom": "oom_gpu", "oom_forward": "oom_gpu", "hang": "hang", "hang_forward": "hang",
          "nonfinite": "nonfinite",
          "corrupt_newest": "crash"}


@dataclass
class Episode:
    n: int
    plan: list[str]
    injected: Counter = field(default_factory=Counter)
    recovered: Counter = field(default_factory=Counter)
    steps_lost: Counter = field(default_factory=Counter)
    finished: bool = False
    bitwise: bool | None = None  # None: not applicable (oom/nonfinite injected)
    once_ok: bool | None = None
    bad_loads: int = 0
    bytes_rewritten: int = 0
    intervals: list[int] = field(default_factory=list)  # every_steps chosen under auto
    committed_lost: int = 0
    leftovers: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    planned: dict[int, list[str]] = field(default_factory=dict)  # attempt -> kinds, in order


class Driver:
    """Runs one episode: starts rtrain (again after preempt / supervisor_kill) and performs the
    external faults when their attempt runs."""

    def __init__(self, ep: Episode, run: Path, rng: random.Random) -> None:
        self.ep, self.run, self.rng = ep, run, rng
        self.marker = str(run)

    def session(self, items: list[str], first_attempt: int) -> tuple[int, str | None]:
        """One rtrain process; returns (its exit code, the session-ending fault if any)."""
        spec, external = [], {}
        for i, kind in enumerate(items):
            a = first_attempt + i
            # rtrain SIGKILLed mid-attempt launches the same attempt number again
            self.ep.planned.setdefault(a, []).append(kind)
            step = self.rng.randint(1, SETTINGS["steps"] - 12)
            if kind in ENV_FAULT:
                cond = {"nonfinite": f"step={step},count={SETTINGS['steps']}",
                        "kill_in_save": f"step={step}", "corrupt_newest": f"step={step}"}
                spec.append(f"{kind}@{cond.get(kind, f'step={step}')},attempt={a}")
            else:
                external[a] = kind
        proc = subprocess.Popen(rtrain_cmd(self.run),
                                env=child_env(RTRAIN_FAULTS="; ".join(spec)), cwd=self.run.parent,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ending = None
        # Only what this session's rtrain writes: an older launch of the same attempt number
        # must not trigger the fault planned for this one.
        tail, steps = Tail(self.run / "events.jsonl"), Tail(self.run / "steps.jsonl")
        for t in (tail, steps):
            t.offset = t.path.stat().st_size if t.path.exists() else 0
        stepped: set[int] = set()
        done: set[int] = set()
        give_up_at = time.monotonic() + EPISODE_LIMIT_S
        while proc.poll() is None:
            if time.monotonic() > give_up_at:
                self.ep.problems.append(f"rtrain still running after {EPISODE_LIMIT_S} s")
                proc.kill()
                break
            for e in tail.read():
                if e["kind"] != "launch" or e["attempt"] not in external or e["attempt"] in done:
                    continue
                a, kind = e["attempt"], external[e["attempt"]]
                done.add(a)
                if kind == "kill" and self.rng.random() < 0.2:
                    time.sleep(self.rng.uniform(0.0, 1.5))  # during start-up
                else:
                    deadline = time.monotonic() + 120
                    while a not in stepped and time.monotonic() < deadline and \
                            proc.poll() is None:
                        stepped.update(r["a"] for r in steps.read() if "step" in r)
                        time.sleep(0.005)
                    time.sleep(self.rng.uniform(0.0, 0.4))
                if proc.poll() is not None:
                    break
                if kind == "kill":
                    if kill_child(e["pid"], self.marker):
                        self.ep.injected["kill"] += 1
                elif kind == "preempt":
                    proc.send_signal(signal.SIGTERM)
                    ending = kind
                else:
                    proc.send_signal(signal.SIGKILL)
                    ending = kind
            time.sleep(0.01)
        return proc.wait(), ending

    def go(self) -> None:
        plan, idx = self.ep.plan, 0
        while True:
            state = load_state(self.run) if (self.run / "state.json").exists() else None
            first = state.history.attempt if state else 0
            while (self.run / "attempts" / str(first)).exists():
                first += 1  # as rtrain numbers a launch after an rtrain that died
            items = []
            for kind in plan[idx:]:
                items.append(kind)
                if kind in ("preempt", "supervisor_kill"):
                    break
            idx += len(items)
            code, ending = self.session(items, first)
            if code == 0:
                self.ep.finished = True  # a stop that came too late: the run had finished
                break
            if ending == "preempt":
                if code == 75:
                    self.ep.injected["preempt"] += 1
                else:
                    self.ep.problems.append(f"preempt: rtrain exited {code}, not 75")
                    break
            elif ending == "supervisor_kill":
                self.ep.injected["supervisor_kill"] += 1
                left = wait_gone(self.marker, timeout=10)
                if left:
                    self.ep.problems.append(f"supervisor_kill: {len(left)} process(es) "
                                            "outlived rtrain")
                    for p in left:
                        p.kill()
            else:
                self.ep.problems.append(f"rtrain exited {code}")
                break


def analyse(ep: Episode, run: Path, ref: Path, ckpt_bytes: int) -> None:
    log = step_log(run)
    exits = {e["attempt"]: e for e in events(run, "exit")}
    classes_all = events(run, "classification")
    classes = {c["attempt"]: c for c in classes_all}
    # The kind planned for each launched process: the n-th launch of attempt a took the n-th
    # kind planned for a (rtrain SIGKILLed mid-attempt launches the same number again).
    kind_of: dict[int, str] = {}
    seen: Counter = Counter()
    for e in events(run, "launch"):
        kinds = ep.planned.get(e["attempt"], [])
        kind_of[e["pid"]] = kinds[seen[e["attempt"]]] if seen[e["attempt"]] < len(kinds) \
            else "none"
        seen[e["attempt"]] += 1
    # Injections confirmed by what rtrain recorded (external kills were counted when sent).
    last_kind = {a: ks[min(seen[a], len(ks)) - 1] for a, ks in ep.planned.items() if seen[a]}
    for a, kind in last_kind.items():
        c = classes.get(a)
        if kind in ENV_FAULT and c is not None and c["failure"] == EXPECT[kind]:
            if kind == "kill_in_save" and exits.get(a, {}).get("signal") != "SIGKILL":
                continue
            ep.injected[kind] += 1
    for kind, n in ep.injected.items():  # recovered: the run went on to finish
        ep.recovered[kind] = n if ep.finished else 0
    # Steps lost per fault: how far the faulted process ran past where the next one resumed.
    ran: dict[int, list[int]] = {}
    for rec in log:
        if "step" in rec:
            ran.setdefault(rec["pid"], []).append(rec["step"])
    st = starts(log)
    for rec, nxt in itertools.pairwise(st):
        last = max(ran.get(rec["pid"], []), default=rec["start"])
        ep.steps_lost[kind_of.get(rec["pid"], "none")] += max(0, last - nxt["start"])
    ep.bad_loads = sum(1 for r in st if r["resume_from"] and r["verified_full"] is not True)
    # A corrupted checkpoint is skipped at every launch until it is saved again or pruned:
    # count each failing checkpoint once, and only those no corrupt_newest fault damaged.
    corrupted = {m for c in classes_all for m in re.findall(r"corrupting (checkpoint-\d+)",
                                                             c["reason"])}
    # Quarantined checkpoints verified: rtrain set them aside, it did not find them damaged.
    failing = {Path(s["path"]).name for s in events(run, "skipped_checkpoint")
               if not s["reason"].startswith("quarantined")}
    ep.committed_lost = len(failing - corrupted) * ckpt_bytes
    ep.intervals = [e["every_steps"] for e in events(run, "cadence")]
    if SETTINGS["save_every"]:  # under "auto" the saved steps are not known from the steps
        saves = [s for ss in ran.values() for s in ss if s % SETTINGS["save_every"] == 0]
        ep.bytes_rewritten = (len(saves) - len(set(saves))) * ckpt_bytes
    if not ep.finished:
        return
    if set(kind_of.values()) & NOT_BITWISE:
        traj = surviving(log)
        try:
            check_exactly_once(traj, samples=SETTINGS["samples"], steps=SETTINGS["steps"])
            ep.once_ok = all(len(r["ids"]) == 8 for r in traj.values())
        except AssertionError as e:
            ep.once_ok = False
            ep.problems.append(f"exactly-once: {e}")
    else:
        ep.bitwise = final_state_diff(run, ref) is None
        if not ep.bitwise:
            ep.problems.append("final state differs from the uninterrupted run")


def checkpoint_bytes(ref: Path) -> int:
    for m in sorted((ref / "checkpoints").glob("checkpoint-*/manifest.json")):
        files = json.loads(m.read_text())["files"]
        return sum(f["size"] for f in files.values()) + m.stat().st_size
    return 0


def episode(n: int, base: Path, ref: Path, ckpt_bytes: int, rng: random.Random,
            plan: list[str] | None = None, kinds: tuple[str, ...] = KINDS) -> Episode:
    if plan is None:
        plan = []
        for _ in range(rng.randint(4, 10)):
            kind = rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
            if kind in OOMS and sum(k in OOMS for k in plan) >= 2:  # the floor is batch 1
                others = [k for k in kinds if k not in OOMS]
                if not others:
                    continue
                kind = rng.choices(others, [WEIGHTS[k] for k in others])[0]
            plan.append(kind)
    ep = Episode(n, plan)
    work = base / f"episode-{n}"
    work.mkdir()
    write_config(work / "rtrain.toml", SETTINGS,
                 hang={"warmup_steps": 2, "multiple": 2.0, "floor_s": HANG_S,
                       "ceiling_s": HANG_S, "timeout_s": STARTUP_HANG_S})
    run = work / "run"
    t0 = time.monotonic()
    d = Driver(ep, run, rng)
    try:
        d.go()
    except Exception as e:  # an episode's own failure is reported, the others go on
        ep.problems.append(f"driver: {type(e).__name__}: {e}")
    ep.seconds = time.monotonic() - t0
    left = wait_gone(str(run), timeout=10)
    ep.leftovers = len(left)
    for p in left:
        p.kill()
    analyse(ep, run, ref, ckpt_bytes)
    return ep


def cadence_line(eps: list[Episode]) -> str:
    if SETTINGS["save_every"]:
        return f"every {SETTINGS['save_every']} steps"
    chosen = sorted(n for ep in eps for n in ep.intervals)
    if not chosen:
        return "auto (no interval chosen)"
    return (f"auto: {len(chosen)} choices, every {chosen[0]} to {chosen[-1]} steps, median "
            f"{chosen[len(chosen) // 2]}")


def memory_line() -> str:
    m = SETTINGS.get("memory", 0)
    return "off" if not m else "auto" if m == -1 else f"a snapshot every {m} step(s)"


def table(eps: list[Episode], minutes: float, seed: int, wall: float) -> str:
    injected, recovered, lost = Counter(), Counter(), Counter()
    for ep in eps:
        injected.update(ep.injected)
        recovered.update(ep.recovered)
        lost.update(ep.steps_lost)
    rows = ["| fault | injected | recovered | steps lost (re-executed) | per fault |",
            "|---|---:|---:|---:|---:|"]
    for k in KINDS:
        per = f"{lost[k] / injected[k]:.2f}" if injected[k] else "-"
        rows.append(f"| {k} | {injected[k]} | {recovered[k]} | {lost[k]} | {per} |")
    rows.append(f"| **all** | **{sum(injected.values())}** | **{sum(recovered.values())}** | "
                f"**{sum(lost.values())}** | |")
    bit = [ep for ep in eps if ep.bitwise is not None]
    once = [ep for ep in eps if ep.once_ok is not None]
    runs = len(eps)
    finished = sum(ep.finished for ep in eps)
    lines = [
        "\n".join(rows), "",
        "| check | result |", "|---|---|",
        f"| supervised runs (episodes) | {runs}, {finished} finished (exit 0) |",
        f"| wall time | {wall / 60:.1f} min (asked {minutes:g}), seed {seed} |",
        f"| save cadence | {cadence_line(eps)} |",
        f"| memory tier | {memory_line()} |",
        f"| final weights + optimizer bitwise-identical to the uninterrupted run | "
        f"{sum(ep.bitwise for ep in bit)} of {len(bit)} runs |",
        f"| runs with oom/nonfinite (batch split or lr changed on purpose): every sample of "
        f"every epoch once, effective batch kept | {sum(ep.once_ok for ep in once)} of "
        f"{len(once)} runs |",
        f"| checkpoints loaded that had not verified at `full` | "
        f"{sum(ep.bad_loads for ep in eps)} |",
        "| checkpoint bytes rewritten (steps saved again after a resume) | "
        + (f"{sum(ep.bytes_rewritten for ep in eps):,} |" if SETTINGS["save_every"]
           else "not counted under auto |"),
        f"| committed checkpoint bytes lost (failed verification, not injected) | "
        f"{sum(ep.committed_lost for ep in eps):,} |",
        f"| leftover processes | {sum(ep.leftovers for ep in eps)} |",
    ]
    problems = [f"- episode {ep.n} ({', '.join(ep.plan)}): {p}" for ep in eps
                for p in ep.problems]
    if problems:
        lines += ["", "Problems:", *problems]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, required=True)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--jobs", type=int, default=1, help="episodes run side by side")
    p.add_argument("--dir", type=Path, default=None, help="work dir (default: a temp dir)")
    p.add_argument("--plan", default=None,
                   help="one episode with these faults in order, e.g. hang,oom,preempt")
    p.add_argument("--kinds", default=None,
                   help="draw only these kinds, e.g. crash,crash_forward,oom,oom_forward")
    p.add_argument("--cadence", default=str(SETTINGS["save_every"]),
                   help="save every N steps, or auto (every=\"auto\")")
    p.add_argument("--memory", default=None,
                   help="the memory tier: a snapshot every N steps, or auto (default: off)")
    args = p.parse_args()
    if args.memory is not None:
        if args.memory == "auto":
            SETTINGS["memory"] = -1
        elif args.memory.isdigit() and int(args.memory) > 0:
            SETTINGS["memory"] = int(args.memory)
        else:
            p.error("--memory: a positive number of steps, or auto")
    if args.cadence == "auto":
        SETTINGS["save_every"] = 0
    elif args.cadence.isdigit() and int(args.cadence) > 0:
        SETTINGS["save_every"] = int(args.cadence)
    else:
        p.error("--cadence: a positive number of steps, or auto")
    plan = args.plan.split(",") if args.plan else None
    if plan and not set(plan) <= set(KINDS):
        p.error(f"--plan: known kinds are {', '.join(KINDS)}")
    kinds = tuple(args.kinds.split(",")) if args.kinds else KINDS
    if not set(kinds) <= set(KINDS):
        p.error(f"--kinds: known kinds are {', '.join(KINDS)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    base = args.dir or Path(tempfile.mkdtemp(prefix="rtrain-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"chaos: seed {seed}, work dir {base}", flush=True)
    t0 = time.monotonic()
    ref = reference(base, SETTINGS)
    ckpt_bytes = checkpoint_bytes(ref)
    end = t0 + args.minutes * 60
    eps: list[Episode] = []
    lock = threading.Lock()
    counter = iter(range(1 << 30))

    def worker(j: int) -> None:
        rng = random.Random(seed * 1000 + j)
        while time.monotonic() < end or (plan and not eps):
            with lock:
                n = next(counter)
            ep = episode(n, base, ref, ckpt_bytes, rng, plan, kinds)
            with lock:
                eps.append(ep)
                total = sum(sum(e.injected.values()) for e in eps)
            status = "ok" if ep.finished and not ep.problems else f"PROBLEMS {ep.problems}"
            print(f"episode {n}: {sum(ep.injected.values())} faults {dict(ep.injected)} in "
                  f"{ep.seconds:.0f} s: {status} (total {total})", flush=True)
            if plan:
                return

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    eps.sort(key=lambda e: e.n)
    print()
    print(f"rtrain chaos: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(table(eps, args.minutes, seed, wall))
    leftover = leftovers(str(base))
    bad = any(ep.problems for ep in eps) or leftover
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
