"""A hang, a non-finite loss and a corrupted newest checkpoint, each injected into a real
supervised run (RTRAIN_FAULTS), are recovered from and the run finishes."""

from __future__ import annotations

import re

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
from rtrain.supervisor.records.recovery import PHASES

HANG_TIMEOUT_S = 3.0


@pytest.mark.slow
def test_hang_is_detected_within_the_timeout_stacks_dumped_and_relaunched(tmp_path):
    # The reference of test_failsave_process.py and test_hang_save.py (step_sleep aside): one
    # run the suite makes once.
    settings = {"steps": 30, "save_every": 8, "keep": 10, "step_sleep": 0.02}
    ref = reference(tmp_path, settings)
    # floor = ceiling: the learned timeout is exactly HANG_TIMEOUT_S whatever the step times.
    write_config(tmp_path / "rtrain.toml", settings,
                 hang={"warmup_steps": 2, "multiple": 2.0, "floor_s": HANG_TIMEOUT_S,
                       "ceiling_s": HANG_TIMEOUT_S})
    run = tmp_path / "run"
    r = launch_chaos(run, faults="hang@step=24")
    assert r.returncode == 0, r.stderr[-3000:]

    cls = events(run, "classification")
    assert [c["failure"] for c in cls] == ["hang"], cls
    silent, allowed = map(float, re.search(r"for ([\d.]+) s \(timeout ([\d.]+) s\)",
                                           cls[0]["reason"]).groups())
    assert allowed == HANG_TIMEOUT_S and silent <= allowed + 1.0, cls[0]["reason"]
    # Measured from outside too: the hang began right after the last step the child logged;
    # the stack dump, written the moment rtrain called the hang, dates the detection.
    hung_at = max(rec["t"] for rec in step_log(run) if rec.get("a") == 0 and "step" in rec)
    stacks = list((run / "attempts" / "0").glob("stacks-*.txt"))
    text = "".join(p.read_text(errors="replace") for p in stacks)
    assert "chaos_train.py" in text and "_sleep_forever" in text, text[-2000:]
    detected_at = max(p.stat().st_mtime for p in stacks if p.stat().st_size)
    assert detected_at - hung_at <= HANG_TIMEOUT_S + 1.0, detected_at - hung_at

    # The hang came at the start of maybe_save(24), before its save: resume from 16.
    assert events(run, "launch")[1]["resume_from"].endswith("/checkpoint-16")
    assert final_state_diff(run, ref) is None
    assert wait_gone(str(run)) == []

    # What the hang cost, from rtrain's verdict on: the stack dump and the stop are its
    # teardown. The last step is the last heartbeat's (a killed process sends no held one).
    cost = events(run, "recovery")[0]
    assert (cost["failure"], cost["failed_attempt"], cost["complete"]) == ("hang", 0, True)
    assert events(run, "exit")[0]["hang_at"] == pytest.approx(detected_at, abs=1.0)
    assert all(cost[f"{p}_s"] is not None for p in PHASES) and cost["teardown_s"] > 0
    last = max(rec["step"] for rec in step_log(run) if rec.get("a") == 0 and "step" in rec)
    # Step heartbeats go out at most every 0.2 s (10 steps here): the last may be the save's.
    assert cost["resumed_step"] == 16 and 16 <= cost["last_step"] <= last
    assert cost["steps_lost"] == cost["last_step"] - 16


@pytest.mark.slow
def test_nonfinite_loss_rolls_back_a_checkpoint_with_the_lr_cut(tmp_path):
    settings = {"steps": 70, "save_every": 4, "lr": 0.01}
    write_config(tmp_path / "rtrain.toml", settings, lr_factor_on_nonfinite=0.5)
    run = tmp_path / "run"
    # NaN losses from step 41: the guard skips five in a row, then ends the attempt at step 45.
    r = launch_chaos(run, faults="nonfinite@step=41,count=8")
    assert r.returncode == 0, r.stderr[-3000:]

    assert [c["failure"] for c in events(run, "classification")] == ["nonfinite"]
    decision = events(run, "decision")[0]
    assert decision["resume"] == "rollback" and "lr 0.01 -> 0.005" in decision["reason"]
    first, second = events(run, "launch")
    assert first["resume_from"] is None
    # The newest checkpoint was checkpoint-44 (saved over a skipped step); the one before it
    # is taken, with the learning rate halved.
    assert second["resume_from"].endswith("/checkpoint-40")
    assert second["settings"]["lr"] == 0.005
    resumed = starts(step_log(run))[-1]
    assert resumed["start"] == 40 and resumed["verified_full"] is True
    import torch

    final = torch.load(run / "final.pt")
    assert final["step"] == settings["steps"]
    assert {g["initial_lr"] for g in final["opt"]["param_groups"]} == {0.005}
    assert all(torch.isfinite(t).all() for t in final["model"].values())
    assert wait_gone(str(run)) == []


@pytest.mark.slow
def test_corrupted_newest_checkpoint_is_skipped_with_the_reason(tmp_path):
    settings = {"steps": 30, "save_every": 8, "keep": 10}  # the hang test's reference
    ref = reference(tmp_path, settings)
    write_config(tmp_path / "rtrain.toml", settings)
    run = tmp_path / "run"
    # After checkpoint-24 is committed, flip a byte of it and crash.
    r = launch_chaos(run, faults="corrupt_newest@step=24")
    assert r.returncode == 0, r.stderr[-3000:]

    skipped = events(run, "skipped_checkpoint")
    assert [s["path"].rsplit("/", 1)[-1] for s in skipped] == ["checkpoint-24"], skipped
    assert "model.safetensors" in skipped[0]["reason"], skipped[0]["reason"]
    assert "skipping checkpoint-24" in r.stderr  # said to the user too, with the reason
    assert events(run, "launch")[1]["resume_from"].endswith("/checkpoint-16")
    assert final_state_diff(run, ref) is None
    left = sorted((run / "checkpoints").glob("checkpoint-*"))
    assert left and all(verify(p, Level.FULL).ok for p in left)
    assert wait_gone(str(run)) == []
