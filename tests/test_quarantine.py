"""Quarantine of a poisoned checkpoint: a checkpoint that verifies, but that attempts resumed
from keep failing the same way before committing anything newer, is set aside; resume falls
back to the one before it; retention and inspect see it."""

from __future__ import annotations

import json

import pytest
from conftest import build_checkpoint
from harness import CHILDREN, events, launch, run_rtrain

from rtrain.checkpoint import quarantine
from rtrain.supervisor.records.runstate import load_state
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.supervisor.retention.prune_dir import prune


@pytest.mark.slow
def test_poisoned_checkpoint_is_quarantined_and_resume_falls_back(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    r = launch(run, str(CHILDREN / "poisoned_checkpoint.py"), str(ckpts), "40", "20")
    assert r.returncode == 0, r.stderr
    launches = events(run, "launch")
    resumed = [e["resume_from"] and e["resume_from"].rsplit("/", 1)[-1] for e in launches]
    # 0 writes the poisoned checkpoint-20; 1 and 2 resume from it and crash; then the fallback
    assert resumed == [None, "checkpoint-20", "checkpoint-20", "checkpoint-15"]
    [q] = events(run, "quarantine")
    assert q["path"].endswith("checkpoint-20") and q["step"] == 20 and q["attempt"] == 2
    assert "2 attempts in a row resumed from it and failed (crash)" in q["reason"]
    assert not events(run, "give_up")  # the crash-loop rule (3) did not fire first
    state = load_state(run)
    assert [e["step"] for e in state.history.quarantined] == [20]
    # The fallback attempt saved step 20 again: a new checkpoint, not quarantined.
    assert quarantine.reason_for(ckpts / "checkpoint-20", quarantine.load(ckpts)) is None
    status = run_rtrain("status", str(run))
    assert "checkpoint-20 quarantined: 2 attempts in a row" in status.stdout


def _quarantined_dir(tmp_path):
    ckpts = tmp_path / "ckpts"
    for step in (5, 10):
        build_checkpoint(ckpts, step)
    path = ckpts / "checkpoint-10"
    quarantine.publish(ckpts, [{"path": str(path), "id": quarantine.checkpoint_id(path),
                                "step": 10, "reason": "2 attempts in a row failed"}])
    return ckpts


def test_retention_keeps_the_fallback_and_the_quarantined_one(tmp_path):
    ckpts = _quarantined_dir(tmp_path)
    report = prune(ckpts, RetentionPolicy(keep=1))
    assert not report.removed
    assert {p.name for p in ckpts.iterdir()} >= {"checkpoint-5", "checkpoint-10"}
    (ckpts / quarantine.QUARANTINE_FILE).unlink()  # without the quarantine: 5 would go
    assert [r.path.name for r in prune(ckpts, RetentionPolicy(keep=1), dry_run=True).removed] \
        == ["checkpoint-5"]


@pytest.mark.slow
def test_inspect_shows_quarantined_and_resume_skips_it(tmp_path):
    ckpts = _quarantined_dir(tmp_path)
    r = run_rtrain("inspect", str(ckpts), "--json", "--verify", "full")
    assert r.returncode == 0, r.stderr  # set aside, not failed
    rows = {e["name"] if "name" in e else e["path"].rsplit("/", 1)[-1]: e
            for e in json.loads(r.stdout)["checkpoints"]}
    assert rows["checkpoint-10"]["status"] == "quarantined"
    assert rows["checkpoint-10"]["reason"] == "2 attempts in a row failed"
    assert rows["checkpoint-5"]["resume"] is True
    text = run_rtrain("inspect", str(ckpts)).stdout
    assert "quarantined: 2 attempts in a row failed" in text


@pytest.mark.slow
def test_retry_lifts_the_quarantine(tmp_path):
    from rtrain.supervisor.decide.policy import History
    from rtrain.supervisor.records.runstate import RunState, RunStatus, save_state

    run = tmp_path / "run"
    ckpts = _quarantined_dir(run)  # run/ckpts: 5 and the quarantined 10
    entry = {**next(iter(quarantine.load(ckpts).values())), "path": str(ckpts / "checkpoint-10")}
    save_state(run, RunState(command=[], status=RunStatus.GAVE_UP, reason="crash loop",
                             history=History(attempt=3, quarantined=(entry,))))
    args = ("--ckpt-dir", str(ckpts), str(CHILDREN / "print_resume_from.py"))
    assert launch(run, *args).returncode == 5
    r = launch(run, "--retry", *args)
    assert r.returncode == 0, r.stderr
    assert events(run, "launch")[-1]["resume_from"].endswith("checkpoint-10")
    assert not (ckpts / quarantine.QUARANTINE_FILE).exists()
    assert load_state(run).history.quarantined == ()
