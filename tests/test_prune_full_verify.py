"""Retention never trades good checkpoints for a bad one: what it relies on (the newest good one,
the newest `keep`, the best `keep_best`) is verified fully before anything is deleted, in
`rtrain prune` and in the worker's in-process retention; both say what they kept and why."""

from __future__ import annotations

import json
import logging
import os
import re
import time

import pytest
from harness import checkpoint_steps

from rtrain.checkpoint.manifest import dumps
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.retention import prune_dir as prune_mod
from rtrain.supervisor.retention.decide import RetentionPolicy


def flip_a_byte(ckpt) -> None:
    """One byte inside the tensor data, size unchanged: only full verification sees it."""
    path = ckpt / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    assert verify(ckpt, Level.QUICK).ok and not verify(ckpt, Level.FULL).ok


@pytest.fixture
def four(tmp_path, make_ckpt):
    d = tmp_path / "checkpoints"
    for step, loss in ((100, 0.1), (200, 0.2), (300, 0.3), (400, 0.4)):
        make_ckpt(d, step, metrics={"loss": loss})
    return d


def test_cli_prune_keeps_the_newest_that_verifies_fully(rtrain, four):
    flip_a_byte(four / "checkpoint-400")
    r = rtrain("prune", str(four), "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(four) == [300, 400]
    kept = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln.startswith("kept ")}
    assert "the newest that verifies (verified full)" in kept["checkpoint-300"]
    assert "content hash does not match" in kept["checkpoint-400"]
    assert "left for a person" in kept["checkpoint-400"]
    assert r.stdout.splitlines()[-1].endswith("kept 2 checkpoints: checkpoint-400, "
                                              "checkpoint-300")
    r = rtrain("inspect", str(four), "--verify", "full", "--json")
    assert r.returncode == 1 and '"resume": "' + str(four / "checkpoint-300") in r.stdout


def test_cli_prune_walks_past_several_bad_ones(rtrain, four):
    flip_a_byte(four / "checkpoint-400")
    flip_a_byte(four / "checkpoint-300")
    r = rtrain("prune", str(four), "--keep", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert re.search(r"would keep +checkpoint-200 .* the newest that verifies", r.stdout)
    assert rtrain("prune", str(four), "--keep", "1").returncode == 0
    assert checkpoint_steps(four) == [200, 300, 400]


def test_best_by_metric_is_verified_fully_before_the_others_go(four):
    flip_a_byte(four / "checkpoint-100")  # the best loss, but damaged
    report = prune_mod.prune(four, RetentionPolicy(keep=1, keep_best=1, metric="loss"))
    # The next best takes its place; the damaged one is older than a good one: removed.
    assert checkpoint_steps(four) == [200, 400]
    assert [v.path.name for v in report.failed_full] == ["checkpoint-100"]
    assert "among the best 1 by loss (min) (verified full)" in report.why[four / "checkpoint-200"]


def test_only_what_is_relied_on_is_hashed(four, monkeypatch):
    from rtrain.checkpoint import hashing

    hashed = []
    real = hashing.hash_file
    monkeypatch.setattr(hashing, "hash_file",
                        lambda p, *a: hashed.append(p.parent.name) or real(p, *a))
    prune_mod.prune(four, RetentionPolicy(keep=2), dry_run=True)
    assert sorted(set(hashed)) == ["checkpoint-300", "checkpoint-400"]


def test_in_process_retention_verifies_fully(tmp_path, caplog, monkeypatch):
    torch = pytest.importorskip("torch")
    import rtrain

    for k in ("RTRAIN_RUN_DIR", "RTRAIN_RESUME_FROM", "RTRAIN_CKPT_DIR", "RTRAIN_SIGNING_KEY",
              "RTRAIN_SIGNING_KEY_FILE"):
        monkeypatch.delenv(k, raising=False)
    model = torch.nn.Linear(64, 64)
    ck = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path, keep=2)
    ck.save(1)
    ck.save(2)
    time.sleep(0.05)  # a later clock tick: the rewrite shows in the file's ctime
    flip_a_byte(tmp_path / "checkpoint-2")
    with caplog.at_level(logging.INFO, logger="rtrain.worker"):
        ck.save(3)
    # checkpoint-2 passed the quick check but not the full one: it is not one of the two kept.
    assert checkpoint_steps(tmp_path) == [1, 3]
    text = caplog.text
    assert "checkpoint-2 passes the quick check but fails full verification" in text
    assert "retention: kept checkpoint-3: the newest that verifies" in text
    assert "checkpoint-1: among the newest 2 (verified full)" in text


def test_a_metric_too_large_for_a_float_does_not_stop_prune(four):
    path = four / "checkpoint-300" / "manifest.json"
    m = json.loads(path.read_bytes())
    m["metrics"] = {"loss": 10**400}  # valid JSON, 401 digits: no float holds it
    path.write_bytes(dumps(m))
    prune_mod.prune(four, RetentionPolicy(keep=1, keep_best=1, metric="loss"))
    assert checkpoint_steps(four) == [100, 400]
