"""The memory tier under `rtrain launch`, with real processes: a training process that dies
abruptly (os._exit: no save, no exception hook, like SIGKILL) mid-snapshot loses at most the
step being snapshotted; rtrain commits the newest complete snapshot to the checkpoint dir
before the relaunch, which reads it from memory; the run ends bitwise-identical to an
uninterrupted one, and the shared-memory directory is gone when the launch ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from harness import CHILDREN, child_env, events, gone, invoke_rtrain, launch, launch_cmd
from references import cached

from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.memtier import shmdir

pytestmark = pytest.mark.slow

SCRIPT = str(CHILDREN / "train_bitwise.py")


def _reference(steps: int) -> dict:
    def make(out):
        subprocess.run([sys.executable, SCRIPT, str(out / "ckpt"), str(out / "final.pt"),
                        str(steps), "0"], env=child_env(), check=True, capture_output=True,
                       timeout=120)

    return torch.load(cached("train_bitwise", {"steps": steps}, make) / "final.pt")


@pytest.mark.soak  # the default tier's: test_live_state.py's kill resumes from memory, bitwise
def test_a_killed_process_resumes_from_its_last_snapshot_in_memory_bitwise(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    # Disk saves every 100 steps (never, in 14): all that survives the death is in memory.
    metrics = tmp_path / "rtrain.prom"
    r = launch(run, "--metrics-file", str(metrics), SCRIPT, str(ckpts), str(out), "14", "8",
               "--every", "100", "--memory", "1", "--die-once", timeout=180)
    assert r.returncode == 0, r.stderr
    # The script dies right after starting the snapshot of step 8: the relaunch resumes from
    # the newest complete snapshot, step 7 (or 8, when its writer beat the exit), committed to
    # the checkpoint dir first and read from memory: at most one step lost.
    persisted = events(run, "snapshot_persisted")
    launches = events(run, "launch")
    assert all(e["why"] == "attempt ended" for e in persisted)
    assert next(e["step"] for e in persisted) in (7, 8)
    assert [e["step"] for e in persisted][-1] == 14  # the end: no disk save came after it
    assert len(launches) >= 2 and all(e.get("tier") == "memory" for e in launches[1:])
    resumed = [int(e["resume_from"].rsplit("-", 1)[1]) for e in launches[1:]]
    assert len(resumed) == 1 and resumed[0] in (7, 8)
    assert all(e["resume_from"].startswith(str(shmdir.path_for(ckpts).parent))
               for e in launches[1:])
    [tier] = [e for e in events(run, "memory_tier") if e["attempt"] == 0]
    assert tier["state"] == "on" and tier["every"] == 1
    final, ref = torch.load(out), _reference(14)
    assert final["step"] == 14
    for k, v in ref["model"].items():
        assert torch.equal(final["model"][k], v), k
    assert not shmdir.path_for(ckpts).exists()  # removed when the launch ended
    assert next(s for s, _ in list_checkpoints(ckpts)) == 14

    # Visible where people look: status, the report, the metrics.
    st = invoke_rtrain("status", "--json", str(run))
    assert st.returncode == 0, st.stderr
    tier = json.loads(st.stdout)["memory_tier"]
    assert tier["state"] == "on" and tier["every"] == 1
    assert tier["persisted"] == len(persisted) and tier["resumes"] == {"memory": 1}
    text = invoke_rtrain("status", str(run)).stdout
    [row] = [line for line in text.splitlines() if line.strip().startswith("memory tier:")]
    assert "a snapshot every 1 step(s)" in row and "resumes read from memory 1" in row
    assert invoke_rtrain("report", str(run), "-o", str(tmp_path / "r.html")).returncode == 0
    assert "(from memory)" in (tmp_path / "r.html").read_text()
    prom = metrics.read_text()
    assert f'rtrain_snapshots_persisted_total{{run_dir="{run.resolve()}"}} {len(persisted)}' \
        in prom
    assert 'tier="memory"} 1' in prom and "rtrain_memory_tier_every_steps" in prom


def test_snapshots_left_by_a_sigkilled_rtrain_are_committed_by_the_next_launch(tmp_path):
    """rtrain SIGKILLed (its child goes with it) persists nothing; the snapshots stay in
    memory, and the next launch commits the newest before its pick, resumes from it, read from
    memory, and ends bitwise-identical to an uninterrupted run."""
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    args = (SCRIPT, str(ckpts), str(out), "40", "0", "--every", "100", "--memory", "1",
            "--step-sleep", "0.05")
    proc = subprocess.Popen(launch_cmd(run, *args), cwd=tmp_path, env=child_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    shm = shmdir.path_for(ckpts)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            steps = [s for s, _ in list_checkpoints(shm)] if shm.exists() else []
            if steps and steps[0] >= 15:
                break
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.02)
        child = events(run, "launch")[0]["pid"]
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert gone(child, timeout=10), "the child outlived its SIGKILLed supervisor"
    assert list_checkpoints(ckpts) == []  # nothing reached the disk tier
    left = [s for s, _ in list_checkpoints(shm)]
    assert left and left[0] >= 15

    r = launch(run, *args, timeout=180)
    assert r.returncode == 0, r.stderr
    found = [e for e in events(run, "snapshot_persisted") if e["why"] == "found at launch"]
    assert [e["step"] for e in found] == [left[0]]
    relaunch = events(run, "launch")[-1]
    assert relaunch["tier"] == "memory" and relaunch["resume_from"].endswith(f"-{left[0]}")
    final, ref = torch.load(out), _reference(40)
    for k, v in ref["model"].items():
        assert torch.equal(final["model"][k], v), k
    assert not shm.exists()


def test_disk_saves_under_the_memory_tier_are_written_by_rtrain_while_the_child_runs(tmp_path):
    """every=4 with snapshots every 4: each scheduled disk save is a snapshot that rtrain
    copies into the checkpoint dir while the child trains on, prunes with the worker's keep=2
    (never the checkpoint the attempt resumed from) and the mirror uploads as it would a
    worker's save. A death after step 10 (os._exit, no Python cleanup) resumes from step 10:
    the live state, sealed by rtrain into a snapshot (worker/memtier/live.py); the run ends
    bitwise-identical to an uninterrupted one."""
    run, out, mirror = tmp_path / "run", tmp_path / "out.pt", tmp_path / "mirror"
    ckpts = run / "checkpoints"
    mirror.mkdir()
    r = launch(run, "--mirror", str(mirror), SCRIPT, str(ckpts), str(out), "20", "10",
               "--die-once", "--every", "4", "--memory", "4", "--step-sleep", "0.1", timeout=180)
    assert r.returncode == 0, r.stderr
    persisted = events(run, "snapshot_persisted")
    by_rtrain = [e for e in persisted if e["why"] == "disk cadence"]
    assert all(e["step"] % 4 == 0 for e in by_rtrain), persisted  # the disk cadence's steps
    assert [e["step"] for e in events(run, "snapshot_sealed")] == [10]
    assert [e["step"] for e in persisted if e["why"] == "attempt ended"] == [10]
    assert [e["step"] for e in by_rtrain][-1] == 20
    # While each attempt ran, not only at its end: before that attempt's exit event.
    exits = {e["attempt"]: e["seq"] for e in events(run, "exit")}
    during = [e for e in by_rtrain if e["seq"] < exits[e["attempt"]]]
    assert {e["attempt"] for e in during} == {0, 1} and len(during) >= 3, persisted
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1].get("tier") == "memory"
    resumed = int(launches[1]["resume_from"].rsplit("-", 1)[1])
    assert resumed == 10
    # Every checkpoint on disk is a snapshot rtrain copied (the worker wrote none itself);
    # keep=2 of all that were committed, plus the one attempt 1 resumed from.
    on_disk = {s: p for s, p in list_checkpoints(ckpts)}
    committed = {e["step"] for e in persisted}
    assert set(on_disk) == set(sorted(committed)[-2:]) | {resumed}, (on_disk, committed)
    for p in on_disk.values():
        assert verify(p, Level.FULL, None).manifest["info"].get("memory_snapshot") is True
    # The mirror took rtrain's copies as they came, not only the last at the run's end.
    uploaded = {e["step"] for e in events(run, "mirror_uploaded")}
    assert uploaded & {e["step"] for e in during if e["step"] < 20}, (uploaded, persisted)
    assert events(run, "mirror_final")[-1]["step"] == 20
    final, ref = torch.load(out), _reference(20)
    assert final["step"] == 20
    for k, v in ref["model"].items():
        assert torch.equal(final["model"][k], v), k
