"""The checkpoint disk fills up mid-run (a small tmpfs): training goes on, saves that do not fit
are skipped, the checkpoints already there stay intact (a crash while the disk is full resumes
from one of them), and the run finishes bitwise-identical."""

from __future__ import annotations

import pytest
from chaos_util import (
    final_state_diff,
    launch_chaos,
    reference,
    starts,
    step_log,
    wait_gone,
    write_config,
)
from harness import events

from rtrain.checkpoint.verify import Level, verify

TRAIN = {"steps": 30, "save_every": 8, "keep": 10}  # the reference other chaos tests make


@pytest.fixture
def small_disk(small_tmpfs):
    return small_tmpfs("8m")


@pytest.mark.slow
def test_full_disk_skips_saves_keeps_old_checkpoints_and_finishes(tmp_path, small_disk):
    ref = reference(tmp_path, TRAIN)
    ckpts = small_disk / "checkpoints"
    # The script fills the disk at step 10 and frees it at step 26; attempt 0 crashes at step
    # 20, while the disk is full, so attempt 1 must resume from a checkpoint made before.
    settings = {**TRAIN, "fill_at": 10, "unfill_at": 26, "fill_path": str(small_disk / "filler")}
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    r = launch_chaos(run, "--ckpt-dir", str(ckpts), faults="crash@step=20")
    assert r.returncode == 0, r.stderr[-3000:]

    assert [c["failure"] for c in events(run, "classification")] == ["crash"]
    assert not events(run, "skipped_checkpoint"), "a checkpoint failed verification"
    assert events(run, "launch")[1]["resume_from"] == str(ckpts / "checkpoint-8")
    resumed = starts(step_log(run))[-1]
    assert resumed["start"] == 8 and resumed["verified_full"] is True
    for attempt in ("0", "1"):
        err = (run / "attempts" / attempt / "stderr.log").read_text()
        assert "skipping this checkpoint" in err, err[-2000:]
    # Training went on while the disk was full: every step 9..19 ran in attempt 0.
    ran = {rec["step"] for rec in step_log(run) if rec.get("a") == 0 and "step" in rec}
    assert set(range(1, 20)) <= ran
    assert final_state_diff(run, ref) is None
    left = sorted(ckpts.glob("checkpoint-*"))
    assert left and all(verify(p, Level.FULL).ok for p in left)
    assert not list(ckpts.glob(".tmp-*")), "a temp dir was left behind"
    assert wait_gone(str(run)) == []
