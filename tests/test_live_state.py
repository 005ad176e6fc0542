"""The live state (worker/memtier/live.py, supervisor/memtier/live_seal.py) under `rtrain
launch`, with real processes and real SIGKILLs: a kill in the forward resumes from the step
before it, sealed by rtrain from shared memory (no snapshot of that step was taken); a kill
inside `optimizer.step()` finds no mark and resumes from the newest snapshot instead. Both runs
end bitwise-identical to an uninterrupted one."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import harness
import pytest
from chaos_util import (
    Tail,
    final_state_diff,
    kill_child,
    reference,
    rtrain_cmd,
    starts,
    step_log,
    write_config,
)
from harness import child_env, events, run_child

from rtrain.checkpoint.layout import list_checkpoints

pytestmark = pytest.mark.slow

# A snapshot every 10 steps (Saving(memory=10)): a kill after step 15 finds the newest at 10, so
# only the live state holds step 15. Each step pauses 0.2 s where the kill is aimed.
BASE = {"save_every": 0, "memory": 10, "steps": 30, "width": 256, "batch_size": 32}
KILL_AFTER = 15


def _kill_in_step(run: Path, proc: subprocess.Popen, after: int) -> int:
    """SIGKILL the training child 0.08 s into the step after `after`; the newest step done."""
    steps, launches = Tail(run / "steps.jsonl"), Tail(run / "events.jsonl")
    pid, done = None, 0
    deadline = time.monotonic() + 120
    while done < after and time.monotonic() < deadline and proc.poll() is None:
        for e in launches.read():
            if e["kind"] == "launch":
                pid = e["pid"]
        for rec in steps.read():
            done = rec.get("step", done)
        time.sleep(0.005)
    time.sleep(0.08)
    for rec in steps.read():
        done = rec.get("step", done)
    assert pid is not None and kill_child(pid, str(run)), "the training child was not found"
    return done


def _run_with_a_kill(tmp_path: Path, settings: dict) -> tuple[Path, int, str]:
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    proc = subprocess.Popen(rtrain_cmd(run), env=child_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        done = _kill_in_step(run, proc, KILL_AFTER)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    return run, done, err


def test_a_sigkill_in_the_forward_resumes_from_the_step_before_it(tmp_path):
    settings = {**BASE, "forward_sleep": 0.2}
    ref = reference(tmp_path, settings, timeout=300)
    run, done, err = _run_with_a_kill(tmp_path, settings)
    assert "live state on:" in err, err[-3000:]
    sealed = events(run, "snapshot_sealed")
    assert [(e["attempt"], e["step"]) for e in sealed] == [(0, done)], (sealed, err[-3000:])
    resumed = {rec["a"]: rec["start"] for rec in starts(step_log(run))}
    assert resumed[1] == done  # no step lost: the kill came before the optimizer's step
    # The relaunch read the sealed state from memory while rtrain copied it to the checkpoint
    # dir (memtier/background_commit.py): the copy's record comes after the launch.
    kinds = [(e["kind"], e.get("attempt"), e.get("step")) for e in events(run)]
    launch = kinds.index(("launch", 1, None))
    persisted = kinds.index(("snapshot_persisted", 0, done))
    assert launch < persisted, kinds
    assert events(run, "launch")[1]["tier"] == "memory"
    assert final_state_diff(run, ref) is None


@pytest.mark.soak  # the seal's side, no mark no snapshot, is test_live_units.py's
def test_a_sigkill_inside_the_optimizer_step_resumes_from_the_newest_snapshot(tmp_path):
    settings = {**BASE, "optimizer_sleep": 0.2}
    ref = reference(tmp_path, settings, timeout=300)
    run, done, err = _run_with_a_kill(tmp_path, settings)
    assert "live state on:" in err, err[-3000:]
    assert not events(run, "snapshot_sealed")  # no mark: the state may mix two steps
    resumed = {rec["a"]: rec["start"] for rec in starts(step_log(run))}
    assert resumed[1] == done // 10 * 10, (resumed, done)
    assert final_state_diff(run, ref) is None


@pytest.fixture
def shm_for_two(tmp_path):
    """A real tmpfs of 2.5 MiB: room for the tier's two snapshots of the small model (each
    counted with 1 MiB of headroom), not for the live state's third copy."""
    with harness.tmpfs(tmp_path / "shm-for-two", "2560k") as where:
        yield where


def test_a_shared_memory_without_room_for_it_leaves_the_snapshots_on(tmp_path, shm_for_two):
    settings = {"save_every": 0, "memory": -2, "steps": 12}
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    r = run_child(rtrain_cmd(run), env=child_env(RTRAIN_SHM_ROOT=str(shm_for_two)),
                  cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stderr.splitlines() if "live state" in ln]
    assert len(said) == 1 and "live state off" in said[0] and "shared-memory" in said[0], said
    assert [e["state"] for e in events(run, "memory_tier")][:1] == ["on"]
    assert next(s for s, _ in list_checkpoints(run / "checkpoints")) == 12
