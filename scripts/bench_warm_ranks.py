"""Warm ranks benchmark: two DDP ranks on gloo (scripts/bench_children/warm_ranks.py), rank 1
SIGKILLed in steady state; seconds from the kill to the group's first step after the restore,

- under `rtrain launch --nproc-per-node 2 --no-backoff`, the kill once the warm standby is
  ready: the relaunch hands the group to it (proc/ranks.py, standby/rank_host.py), with the
  phases of the recovery event (teardown: from the kill to the attempt's end);
- re-running torchrun on the same script (a shell loop: `until torchrun ...; do :; done`),

in the same run, alternated, and the ratio of the medians.

`--nodes`: a whole node lost in a two-node run on 127.0.0.1 instead (one rank per node, the
rendezvous on 127.0.0.1:PORT, one shared checkpoint dir): once the surviving node's standby is
ready, node b's supervisor (or torchrun) and every process under it are SIGKILLed and a
replacement node is started at once, as a scheduler would; seconds from the kill to the group's
first step after the restore,

- under two `rtrain launch --nnodes 2` (the survivor's relaunch starts its rank from its warm
  standby, which joins the rendezvous; the replacement's first attempt runs torchrun);
- re-running torchrun on both nodes (each node a shell loop `until torchrun ...; do :; done`).

`--nodes-rank`: the same two nodes, rank 1 killed alone (its node's supervisor lives on): both
nodes relaunch, each from its warm standby under rtrain.

`--nodes-elastic`: `--nnodes 1:2`, a whole node lost and its replacement started at once, as
with `--nodes`: under rtrain the survivor's warm relaunch goes on alone after a last call of a
second (standby/rank_rdzv.py) and takes the replacement in at the next round; torchrun on both
nodes is re-run with the same `--nnodes 1:2` and the same last call
(`--rdzv-conf=last_call_timeout=1`), so both wait alike, and, with `--fixed-too`, for
reference, with `--nnodes 2` as in `--nodes`. The run checks that the group grew back to two
nodes under rtrain.
`--warm-kill` loses node b in attempt 1, which both nodes started warm, as in a long run's later
failures (the first attempt is torchrun's, and so is its teardown).

usage: python scripts/bench_warm_ranks.py [--repeats 3] [--warm-kill]
                                          [--nodes | --nodes-rank | --nodes-elastic [--fixed-too]]
Target: under rtrain at most 0.25x re-running torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
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
RERUNS = 5  # the torchrun loop's tries after the kill
FINISH_S = 30  # once a node ended well, how long the others have to end too


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
        for _ in range(RERUNS):  # ... until it succeeds (its time counts)
            again = subprocess.run(cmd, env=env(BENCH_RUN="1"), timeout=TIMEOUT_S, **quiet)
            if again.returncode == 0:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
    if again.returncode != 0:
        raise SystemExit(f"torchrun again: exit status {again.returncode}, {RERUNS} times")
    return kill_to_step(out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_tree(proc: subprocess.Popen) -> None:
    """A node lost whole: the process and every one below it SIGKILLed at once (rtrain starts
    each attempt, and its standby, in a session of its own)."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    psutil.wait_procs(procs, timeout=10)


class Node:
    """One simulated node: its command, run again while it fails (`loop`), as a shell loop or
    a scheduler would."""

    def __init__(self, cmd: list[str], out: Path, loop: bool, **extra: str) -> None:
        self.cmd, self.out, self.loop, self.extra = cmd, out, loop, extra
        self.runs = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        e = env(**self.extra, BENCH_RUN=str(self.runs))
        self.runs += 1
        return subprocess.Popen(self.cmd, env=e, cwd=self.out, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def poll(self) -> int | None:
        """None while it runs (a failed run is started again when looping), else its status."""
        code = self.proc.poll()
        if code is not None and code != 0 and self.loop:
            self.proc = self._start()
            return None
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)


ELASTIC_LAST_CALL = "last_call_timeout=1"
"""torchrun's last call in `--nodes-elastic`: the one a warm relaunch of rtrain's uses
(standby/rank_rdzv.RELAUNCH_LAST_CALL_S)."""


def two_nodes(out: Path, rtrain: bool, whole: bool = True, elastic: bool = False,
              kill_run: int = 0) -> tuple[float, list, dict]:
    """(whole node lost -> the group's first resumed step, node a's launches, the phases of
    node a's first recovery event) for two nodes
    under rtrain (rtrain=True) or re-running torchrun. `whole=False`: only rank 1 is killed (it
    SIGKILLs itself), both supervisors live on and relaunch. `elastic`: `--nnodes 1:2`.
    `kill_run` 1 (rtrain only): node b is lost in attempt 1, which both nodes started warm
    (rank 1 SIGKILLs itself in attempt 0), as in a long run's later failures."""
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    nnodes = "1:2" if elastic else "2"

    def cmd(name: str) -> list[str]:
        if rtrain:
            return [sys.executable, "-m", "rtrain", "launch", "--run-dir",
                    str(out / f"run-{name}"), "-q", "--no-backoff", "--ckpt-dir",
                    str(out / "checkpoints"), "--nnodes", nnodes, "--nproc-per-node", "1",
                    "--rdzv-endpoint", endpoint, str(KID), str(out), str(STEPS)]
        conf = [f"--rdzv-conf={ELASTIC_LAST_CALL}"] if elastic else []
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                "--rdzv-id=bench", *conf, "--max-restarts=0", str(KID), str(out), str(STEPS)]

    events = out / "run-a" / "events.jsonl"
    grow = {"BENCH_GROW": "1"} if elastic else {}
    grow["BENCH_KILL_RUN"] = str(kill_run)
    a, b = (Node(cmd(n), out, not rtrain, **grow) for n in ("a", "b"))
    nodes = [a, b]
    try:
        deadline = time.monotonic() + TIMEOUT_S

        def running() -> None:
            if any(n.poll() is not None for n in nodes) or time.monotonic() > deadline:
                raise SystemExit(f"two nodes ({'rtrain' if rtrain else 'torchrun'}): a node "
                                 f"ended (exit status {[n.proc.poll() for n in nodes]})")
            time.sleep(0.05)

        logs = [events] if whole else [events, out / "run-b" / "events.jsonl"]
        while not ((out / "steady").exists() and (not rtrain or all(
                e.exists() and e.read_bytes().count(b'"kind":"standby_ready"') > kill_run
                for e in logs))):
            running()
        if whole:
            (out / "killed").write_text(repr(time.time()))
            b.stop()
            nodes = [a, Node(cmd("b2"), out, not rtrain, **grow)]  # the replacement, at once
        else:
            (out / "kill").touch()
        while not (out / "stepping").exists():
            running()
        # The group ends 20 steps past its restore. Every node is polled each time round, so a
        # torchrun loop starts a node's failed run again while another node still runs (over
        # a range the survivor waits, alone, for the replacement's next run), until a node
        # ended well: the group finished, and a torchrun that fails after it (its exit
        # barrier, its rendezvous' shutdown) would wait alone for a group that is gone.
        finished = None
        while time.monotonic() < deadline:
            codes = [n.poll() for n in nodes]
            if 0 in codes and finished is None:
                finished = time.monotonic()
                for n in nodes:
                    n.loop = False
            if None not in codes or (finished and time.monotonic() - finished > FINISH_S):
                break
            time.sleep(0.05)
    finally:
        for n in (a, b, *nodes):
            n.stop()
    codes = [n.proc.returncode for n in nodes]
    if (rtrain and any(codes)) or 0 not in codes:
        raise SystemExit(f"two nodes: exit status {codes}")
    launches, phases = [], {}
    if rtrain:
        logged = [json.loads(line) for line in events.read_text().splitlines()]
        launches = [e for e in logged if e.get("kind") == "launch"]
        recovery = [e for e in logged if e.get("kind") == "recovery"
                    and e.get("attempt") == kill_run + 1][:1]
        phases = {k[:-2]: v for e in recovery for k, v in e.items()
                  if k.endswith("_s") and k not in ("total_s", "lost_s", "work_lost_s",
                                                    "step_time_s")}
    return kill_to_step(out), launches, phases


def grew_back(out: Path) -> str:
    """Under `--nnodes 1:2`: the group's size in each of its runs (the bench child's
    OUT/worlds): two nodes, the survivor alone, and both nodes again once the replacement was
    taken in."""
    sizes = (out / "worlds").read_text().split()
    if "1" not in sizes or sizes[-1] != "2":
        raise SystemExit(f"--nodes-elastic: the group never went on alone and grew back to two "
                         f"nodes: world sizes {sizes}")
    return " -> ".join(sizes)


def main_nodes(repeats: int, whole: bool, elastic: bool = False, kill_run: int = 0,
               fixed_too: bool = False) -> None:
    what = "a whole node of two lost" if whole else "a rank of one node of two killed"
    if elastic:
        what += ", --nnodes 1:2"
    if kill_run:
        what += ", in a warm attempt"
    warm, cold, fixed = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            t, _, _ = two_nodes(Path(d) / f"torchrun-{i}", rtrain=False, whole=whole,
                                elastic=elastic)
            cold.append(t)
            if elastic and fixed_too:  # the plain case's torchrun, `--nnodes 2`, waiting for b2
                t, _, _ = two_nodes(Path(d) / f"torchrun-fixed-{i}", rtrain=False)
                fixed.append(t)
                print(f"run {i}: re-running torchrun with --nnodes 2: {t:.2f} s", flush=True)
            t, launches, phases = two_nodes(Path(d) / f"rtrain-{i}", rtrain=True, whole=whole,
                                            elastic=elastic, kill_run=kill_run)
            warm.append(t)
            started = ["warm" if la.get("standby") else "torchrun" for la in launches]
            sizes = f"; world sizes {grew_back(Path(d) / f'rtrain-{i}')}" if elastic else ""
            print(f"run {i}: {what} -> first resumed step: rtrain {t:.2f} s, re-running "
                  f"torchrun {cold[-1]:.2f} s; node a's attempts: {', '.join(started)}{sizes}; "
                  f"node a's phases {fmt(phases)}", flush=True)
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"median of {repeats}, {what}: rtrain {w:.2f} s, re-running torchrun on both nodes "
          f"{c:.2f} s: ratio {w / c:.2f} (target: at most 0.25)")
    if fixed:
        f = statistics.median(fixed)
        print(f"median of {repeats}, re-running torchrun with --nnodes 2 instead: {f:.2f} s: "
              f"ratio {w / f:.2f}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-kill", action="store_true",
                   help="also kill a rank of a group the standby forked (attempt 1): the "
                        "teardown of warm ranks, which keeping the survivors would save; with "
                        "--nodes or --nodes-elastic: lose node b in attempt 1 (both nodes warm) "
                        "instead of attempt 0 (torchrun); with --nodes-rank: kill rank 1 there")
    p.add_argument("--nodes", action="store_true",
                   help="a whole node lost in a two-node run on 127.0.0.1, a replacement "
                        "started at once")
    p.add_argument("--nodes-rank", action="store_true",
                   help="two nodes on 127.0.0.1, rank 1 killed alone: both nodes relaunch")
    p.add_argument("--nodes-elastic", action="store_true",
                   help="as --nodes under --nnodes 1:2: the survivor goes on alone at once and "
                        "takes the replacement in at the next round")
    p.add_argument("--fixed-too", action="store_true",
                   help="with --nodes-elastic: also re-run torchrun with --nnodes 2, for "
                        "reference (its loop can wait out the timeout when the replacement's "
                        "torchrun fails after the group's end)")
    args = p.parse_args()
    if args.nodes or args.nodes_rank or args.nodes_elastic:
        main_nodes(args.repeats, whole=not args.nodes_rank, elastic=args.nodes_elastic,
                   kill_run=int(args.warm_kill),
                   fixed_too=args.fixed_too)
        return
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
