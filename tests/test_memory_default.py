"""The memory tier with default settings, under `rtrain launch` with real processes: a script
that leaves `memory=` out (here, one that gives only `every="auto"`) gets the tier where its
state fits, said once with what a snapshot costs; its scheduled disk saves are snapshots rtrain
copies, bitwise what the script would have written, and a kill right after one loses nothing;
a shared-memory filesystem too small for it (a real tmpfs, mounted for the test, as a
container's 64 MiB /dev/shm) leaves it off with one line, and the run goes on from the disk
tier. The soak test is the issue's check: eight SIGKILLs at random moments of steady state lose
at most one step each on average, and the run ends bitwise-identical to an uninterrupted one."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
import pytest
import torch
from chaos_util import (
    Tail,
    final_state_diff,
    kill_child,
    reference,
    rtrain_cmd,
    starts,
    step_log,
    wait_gone,
    write_config,
)
from harness import CHILDREN, child_env, events, launch, run_child
from references import cached

from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify

pytestmark = pytest.mark.slow

# Only every="auto" and nothing about memory (chaos_train's memory=-2: `memory=` left out).
DEFAULTS = {"save_every": 0, "memory": -2}


def test_left_out_the_tier_is_on_and_says_once_what_a_snapshot_costs(tmp_path):
    settings = {**DEFAULTS, "steps": 24, "step_sleep": 0.05}  # steps of ~50 ms
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    r = run_child(rtrain_cmd(run), env=child_env(), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    tier = [e for e in events(run, "memory_tier") if e["attempt"] == 0]
    assert tier and all(e["state"] == "on" for e in tier), tier
    measured = [e for e in tier if e.get("measured")]
    assert measured, tier  # the steps measured what a snapshot costs them
    assert measured[0]["bytes"] > 0 and measured[0]["cost_s"] >= 0 and measured[0]["step_s"] > 0
    said = [ln for ln in r.stderr.splitlines() if "memory tier on:" in ln]
    assert len(said) == 1, r.stderr[-3000:]
    assert "iB in " in said[0] and "one every" in said[0], said
    # The tier's snapshot at the end went to the checkpoint dir if it was newer than the disk's.
    assert next(s for s, _ in list_checkpoints(run / "checkpoints")) == 24


BITWISE = str(CHILDREN / "train_bitwise.py")


def _in_process(steps: int, every: int) -> Path:
    """The same script run uninterrupted outside `rtrain launch`, where the default tier is off
    and every save is the script's own write: its checkpoint dir (keep=2) and final state."""
    def make(out):
        subprocess.run([sys.executable, BITWISE, str(out / "ckpt"), str(out / "final.pt"),
                        str(steps), "0", "--every", str(every), "--memory", "-2"],
                       env=child_env(), check=True, capture_output=True, timeout=120)

    return cached("train_bitwise_default", {"steps": steps, "every": every}, make)


def test_a_scheduled_disk_save_is_copied_by_rtrain_bitwise_and_a_kill_after_it_loses_nothing(
        tmp_path):
    """Defaults (`memory=` left out), a disk save every 4 steps: each is a snapshot that rtrain
    copies into the checkpoint dir while the script trains on (the script writes none itself),
    file for file what the script's own save of that step holds. The process dies (os._exit,
    as a SIGKILL) right after handing step 8 over, before rtrain could have copied it: the
    relaunch resumes from step 8, and the run ends bitwise-identical to an uninterrupted one."""
    ref = _in_process(20, 4)
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    r = launch(run, BITWISE, str(ckpts), str(out), "20", "8", "--die-once", "--every", "4",
               "--memory", "-2", "--step-sleep", "0.05", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["resume_from"].endswith("checkpoint-8"), launches
    persisted = events(run, "snapshot_persisted")
    exits = {e["attempt"]: e["seq"] for e in events(run, "exit")}
    during = [e for e in persisted if e["why"] == "disk cadence" and e["seq"] < exits[e["attempt"]]]
    assert during and all(e["step"] % 4 == 0 for e in during), persisted
    on_disk = dict(list_checkpoints(ckpts))
    assert 20 in on_disk, (on_disk, persisted)
    for path in on_disk.values():  # every checkpoint there is a snapshot rtrain copied
        assert verify(path, Level.FULL, None).manifest["info"].get("memory_snapshot") is True
    # rtrain's copy of step 20 holds what the script's own save of step 20 holds, file for file
    # (each file's hash: the tensors, their layout, the RNG states, the data position).
    mine, theirs = mf.load(on_disk[20]), mf.load(ref / "ckpt" / "checkpoint-20")
    assert {n: f["hash"] for n, f in mine["files"].items()} == \
        {n: f["hash"] for n, f in theirs["files"].items()}
    final, expected = torch.load(out), torch.load(ref / "final.pt")
    assert final["step"] == 20
    for k, v in expected["model"].items():
        assert torch.equal(final["model"][k], v), k


@pytest.fixture
def small_shm(tmp_path):
    """A real tmpfs of 64 KiB: a shared-memory filesystem too small for any snapshot."""
    with harness.tmpfs(tmp_path / "small-shm", "64k") as where:
        yield where


def test_a_shared_memory_too_small_leaves_it_off_with_one_line(tmp_path, small_shm):
    settings = {**DEFAULTS, "steps": 12}
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    r = run_child(rtrain_cmd(run), env=child_env(RTRAIN_SHM_ROOT=str(small_shm)), cwd=tmp_path,
                  timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    [off] = [e for e in events(run, "memory_tier") if e["attempt"] == 0]
    assert off["state"] == "off" and "shared-memory filesystem" in off["reason"], off
    said = [ln for ln in r.stderr.splitlines() if "memory tier" in ln]
    assert len(said) == 1 and "--shm-size" in said[0], r.stderr[-3000:]
    assert next(s for s, _ in list_checkpoints(run / "checkpoints")) == 12  # the disk tier
    assert not events(run, "snapshot_persisted")


@pytest.mark.soak  # the same one-line refusal as the small /dev/shm, from a real cgroup
def test_a_budget_too_tight_leaves_it_off_with_one_line(tmp_path):
    """A real memory cgroup whose room is less than two snapshots of the state (101 MB: the
    MLP below) against the default budget: half of what the cgroup has left."""
    settings = {**DEFAULTS, "steps": 3, "width": 2048, "batch_size": 64}
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    cmd = " ".join(f"'{a}'" for a in rtrain_cmd(run))
    with harness.memory_cgroup("rtrain-budget", 700 << 20) as cg:
        r = run_child(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec {cmd}"],
                      env=child_env(), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    [off] = [e for e in events(run, "memory_tier") if e["attempt"] == 0]
    assert off["state"] == "off" and "budget" in off["reason"], off
    said = [ln for ln in r.stderr.splitlines() if "memory tier" in ln]
    assert len(said) == 1 and "budget" in said[0], r.stderr[-3000:]
    assert next(s for s, _ in list_checkpoints(run / "checkpoints")) == 3
    assert not events(run, "memory_pressure")


# ------------------------------------------------------------------ the check

# The job: an MLP of 8.4M parameters (three hidden layers of 2048), AdamW, 101 MB of
# state, batches of 160: a step of 100-150 ms that keeps both cores busy; every="auto" and
# nothing else. A copy of that state costs 15-40% of such a step, so "auto" spaces the
# snapshots 5-15 steps apart; the live state (worker/memtier/live.py) holds the last boundary
# for a kill anywhere outside optimizer.step(), and the snapshots cover a kill inside it.
SOAK = {**DEFAULTS, "steps": 150, "width": 2048, "batch_size": 160, "samples": 1600}
KILLS = 8
# An attempt's steps before it counts as steady state: past the restore and warm-up, and past
# the first snapshots, whose cost the steps have measured by then (pacing.MIN_SAMPLES of each
# kind at an interval of 2 until then; later attempts start from what the first measured).
STEADY_STEPS = 12


class Killer:
    """SIGKILLs each attempt once it trained STEADY_STEPS steps, after a random delay, and
    records for each kill the newest step the script logged as done."""

    def __init__(self, run, seed: int) -> None:
        self.run, self.rng = run, random.Random(seed)
        self.kills: list[tuple[int, int]] = []  # (attempt, newest step logged before it)

    def loop(self, proc: subprocess.Popen) -> None:
        steps, launches = Tail(self.run / "steps.jsonl"), Tail(self.run / "events.jsonl")
        pids: dict[int, int] = {}
        first: dict[int, int] = {}  # attempt -> the step it started at
        done: dict[int, int] = {}  # attempt -> newest step logged
        armed: dict[int, float] = {}  # attempt -> when to kill it
        while proc.poll() is None and len(self.kills) < KILLS:
            for e in launches.read():
                if e["kind"] == "launch":
                    pids[e["attempt"]] = e["pid"]
            for rec in steps.read():
                if "start" in rec:
                    first[rec["a"]] = rec["start"]
                elif "step" in rec:
                    done[rec["a"]] = rec["step"]
            for a in pids:
                if a in armed or a not in first or done.get(a, 0) - first[a] < STEADY_STEPS:
                    continue
                armed[a] = time.monotonic() + self.rng.uniform(0.0, 1.0)
            for a, when in list(armed.items()):
                if when is not None and time.monotonic() >= when:
                    armed[a] = None
                    for rec in steps.read():  # the newest step logged, right before the kill
                        if "step" in rec:
                            done[rec["a"]] = rec["step"]
                    if kill_child(pids[a], str(self.run)):
                        self.kills.append((a, done[a]))
            time.sleep(0.005)


@pytest.mark.soak  # eight relaunches of a torch script, each after several seconds of training
def test_eight_random_sigkills_with_defaults_lose_at_most_one_step_each_on_average(tmp_path):
    ref = reference(tmp_path, SOAK, timeout=900)  # minutes on a loaded 2-core machine
    write_config(tmp_path / "rtrain.toml", SOAK)
    run = tmp_path / "run"
    proc = subprocess.Popen(rtrain_cmd(run), env=child_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killer = Killer(run, seed=40)
    try:
        killer.loop(proc)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    assert len(killer.kills) == KILLS, killer.kills

    # Steps lost per kill: the newest step the script logged as done before the kill, less
    # the step the next attempt resumed at (the script's own log, not rtrain's).
    resumed = {rec["a"]: rec["start"] for rec in starts(step_log(run))}
    lost = [done - resumed[a + 1] for a, done in killer.kills]
    assert all(n >= 0 for n in lost), lost
    tier = [e for e in events(run, "memory_tier") if e["state"] != "on"]
    assert not tier, tier  # on throughout: never off, never dropped
    print(f"steps lost per kill: {lost}, mean {sum(lost) / len(lost):.2f}")
    assert sum(lost) / len(lost) <= 1.0, (lost, events(run, "memory_tier"))
    measured = [e for e in events(run, "memory_tier") if e.get("measured")]
    assert measured, "no attempt measured what its snapshots cost"
    assert final_state_diff(run, ref) is None
    assert wait_gone(str(run)) == [], "processes of the run are still alive"
