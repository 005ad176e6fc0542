"""Checkpoints changed by someone who can write the checkpoint dir and update the manifest to
match: `Checkpointer.restore()` never runs their code, never uses bytes other than those it
verified, never copies a tensor that does not fit, and falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch
from harness import run_rtrain
from hostile import (
    claim_huge_header,
    code_running_pickle,
    make,
    manifest,
    relist,
    safetensors_bytes,
)
from hostile import table as tensor_table
from hostile import two_checkpoints as shared_two_checkpoints

import rtrain
import rtrain.worker.restoring.restore as restore_module
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.errors import CorruptCheckpoint, ExitCode, StateMismatch

pytestmark = pytest.mark.usefixtures("unsupervised")


def two_checkpoints(ckpt_dir):
    return shared_two_checkpoints(ckpt_dir)[0]


def restored(ckpt_dir, path=None):
    model, opt = make(seed=7)
    step = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir).restore(path)
    return step, model


def inspect_full(ckpt):
    r = run_rtrain("inspect", str(ckpt.parent), "--verify", "full")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---------------------------------------------------------------- 1. no code from a checkpoint


@pytest.mark.slow  # runs `rtrain inspect` as a process
def test_pickle_at_dcp_metadata_never_runs_and_restore_falls_back(tmp_path, caplog):
    weights = two_checkpoints(tmp_path)
    bad = tmp_path / "checkpoint-4"
    marker = tmp_path / "PWNED"
    m = manifest(bad)
    relist(bad, "dcp/.metadata", code_running_pickle(marker),
           info={**m["info"], "layout": "sharded"})
    assert verify(bad, Level.FULL).ok  # the attacker's manifest is consistent
    assert "checkpoint-4" in inspect_full(bad)

    try:
        with caplog.at_level(logging.WARNING):
            step, model = restored(tmp_path)
    finally:
        assert not marker.exists(), "restore() ran code from the checkpoint"
    assert step == 2 and torch.equal(model.weight, weights[2])
    assert "skipping checkpoint-4" in caplog.text
    assert "sharded (DCP) state" in caplog.text and "no process group" in caplog.text
    with pytest.raises(CorruptCheckpoint, match="no process group"):
        restored(tmp_path, bad)
    assert not marker.exists()


def test_under_rtrain_a_bad_checkpoint_is_reported_in_the_exit_record(tmp_path, monkeypatch):
    two_checkpoints(tmp_path / "ckpt")
    bad = tmp_path / "ckpt" / "checkpoint-4"
    marker = tmp_path / "PWNED"
    relist(bad, "dcp/.metadata", code_running_pickle(marker),
           info={**manifest(bad)["info"], "layout": "sharded"})
    status = tmp_path / "attempt"
    status.mkdir()
    monkeypatch.setenv("RTRAIN_RESUME_FROM", str(bad))
    monkeypatch.setenv("RTRAIN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RTRAIN_STATUS", str(status))
    try:
        with pytest.raises(SystemExit) as e:
            restored(tmp_path / "ckpt")
    finally:
        assert not marker.exists(), "restore() ran code from the checkpoint"
    assert e.value.code == ExitCode.BAD_CHECKPOINT
    rec = json.loads((status / "exit-rank0.json").read_text())
    assert rec["kind"] == "bad_checkpoint" and rec["extra"]["checkpoint"] == str(bad)
    assert rec["reason"].startswith("checkpoint-4: cannot load")
    assert not marker.exists()


# ---------------------------------------------------------------- 2. verified, then swapped


def test_same_size_swap_after_the_quick_check_is_caught_while_loading(tmp_path, monkeypatch):
    """The supervisor verified fully; the worker checks sizes, then a same-size file replaces
    model.safetensors before the load: the hash taken while loading catches it."""
    weights = two_checkpoints(tmp_path / "ckpt")
    chosen = tmp_path / "ckpt" / "checkpoint-4"
    other = tmp_path / "ckpt" / "checkpoint-2" / "model.safetensors"
    assert verify(chosen, Level.FULL).ok
    assert other.stat().st_size == (chosen / "model.safetensors").stat().st_size
    real_verify = restore_module.verify

    def verify_then_swap(path, level, key=None):
        v = real_verify(path, level, key)
        (chosen / "model.safetensors").write_bytes(other.read_bytes())  # same size
        return v

    monkeypatch.setattr(restore_module, "verify", verify_then_swap)
    status = tmp_path / "attempt"
    status.mkdir()
    monkeypatch.setenv("RTRAIN_RESUME_FROM", str(chosen))
    monkeypatch.setenv("RTRAIN_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("RTRAIN_STATUS", str(status))
    model, opt = make(seed=7)
    before = model.weight.detach().clone()
    with pytest.raises(SystemExit) as e:
        rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path / "ckpt").restore()
    assert e.value.code == ExitCode.BAD_CHECKPOINT
    assert torch.equal(model.weight, before), "weights other than the verified ones were loaded"
    assert not torch.equal(model.weight, weights[2])
    rec = json.loads((status / "exit-rank0.json").read_text())
    assert "model.safetensors: content hash does not match" in rec["reason"]


def test_signed_checkpoints_hash_their_files_with_blake3(tmp_path, monkeypatch):
    import blake3

    model, opt = make()
    signed = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path / "s",
                                 signing_key="secret").save(1)
    m = manifest(signed)
    assert m["hash_alg"] == "blake3" and m["signature"]["alg"] == "blake3-keyed"
    for name, entry in m["files"].items():
        assert entry["hash"] == blake3.blake3((signed / name).read_bytes()).hexdigest()
    unsigned = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path / "u").save(1)
    assert manifest(unsigned)["hash_alg"] == "xxh3-128"
    monkeypatch.setenv("RTRAIN_SIGNING_KEY", "secret")
    assert verify(signed, Level.FULL, rtrain.Checkpointer(ckpt_dir=tmp_path).key).ok
    model2, opt2 = make(seed=3)
    assert rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path / "s").restore() == 1
    assert torch.equal(model2.weight, model.weight)


def test_a_signed_manifest_over_xxh3_hashes_is_refused_under_a_key(tmp_path, monkeypatch,
                                                                    make_ckpt):
    from rtrain.checkpoint import hashing
    from rtrain.checkpoint import manifest as mf

    key = hashing.derive_key(b"secret")
    ckpt = make_ckpt(tmp_path, 3)  # unsigned, xxh3-128: what an older rtrain wrote
    m = manifest(ckpt)
    mf.sign_manifest(m, key)  # signed as an older rtrain did, over xxh3 file hashes
    (ckpt / "manifest.json").write_bytes(mf.dumps(m))
    v = verify(ckpt, Level.FULL, key)
    assert not v.ok and "not cryptographic" in v.reason and "RTRAIN_ALLOW_XXH3_SIGNED" in v.reason
    monkeypatch.setenv("RTRAIN_ALLOW_XXH3_SIGNED", "1")
    assert verify(ckpt, Level.FULL, key).ok
    assert verify(ckpt, Level.FULL, None).ok  # without a key it is an ordinary checkpoint


def test_old_checkpoints_without_hash_alg_still_load(tmp_path):
    weights = two_checkpoints(tmp_path)
    m = manifest(tmp_path / "checkpoint-4")
    del m["hash_alg"]
    (tmp_path / "checkpoint-4" / "manifest.json").write_text(json.dumps(m))
    step, model = restored(tmp_path)
    assert step == 4 and torch.equal(model.weight, weights[4])


# ---------------------------------------------------------------- 3. shapes and dtypes


def _replace_weight(ckpt, array, honest):
    """model.safetensors with `weight` replaced; the manifest's tensor table updated only when
    `honest` (otherwise it still claims the model's [2, 4] F32)."""
    bias = np.zeros(2, np.float32)
    arrays = {"bias": bias, "weight": array}
    relist(ckpt, "model.safetensors", safetensors_bytes(arrays),
           tensors=tensor_table(arrays) if honest else None)


@pytest.mark.parametrize("array, message", [
    (np.ones(4, np.float32), "layer 'weight' shape mismatch: model [2, 4], checkpoint [4]"),
    (np.ones((2, 4), np.int32), "layer 'weight' dtype mismatch: model F32, checkpoint I32"),
])
def test_a_tensor_that_does_not_fit_is_refused_naming_both(tmp_path, array, message):
    two_checkpoints(tmp_path)
    _replace_weight(tmp_path / "checkpoint-4", array, honest=True)
    model, opt = make(seed=7)
    before = model.weight.detach().clone()
    with pytest.raises(StateMismatch) as e:
        rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).restore()
    assert message in str(e.value)
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize("array, real", [(np.ones(4, np.float32), "F32 [4]"),
                                         (np.ones((2, 4), np.int32), "I32 [2, 4]")])
def test_a_file_that_is_not_what_its_manifest_says_is_a_bad_checkpoint(tmp_path, array, real):
    weights = two_checkpoints(tmp_path)
    _replace_weight(tmp_path / "checkpoint-4", array, honest=False)
    assert verify(tmp_path / "checkpoint-4", Level.FULL).ok
    message = f"tensor 'weight' is {real} in the file but F32 [2, 4] in the manifest"
    with pytest.raises(CorruptCheckpoint, match=re.escape(message)):
        restored(tmp_path, tmp_path / "checkpoint-4")
    step, model = restored(tmp_path)  # picked from the dir: the one before is used
    assert step == 2 and torch.equal(model.weight, weights[2])


def test_optimizer_state_that_does_not_fit_its_parameter_is_refused(tmp_path):
    two_checkpoints(tmp_path)
    ckpt = tmp_path / "checkpoint-4"
    from safetensors.numpy import load_file

    arrays = load_file(ckpt / "optimizer.safetensors")
    arrays["weight/exp_avg"] = np.ones(4, np.float32)
    relist(ckpt, "optimizer.safetensors", safetensors_bytes(arrays),
           tensors=tensor_table(arrays))
    model, opt = make(seed=7)
    before = model.weight.detach().clone()
    with pytest.raises(StateMismatch, match=r"state 'weight/exp_avg' shape mismatch: "
                                            r"parameter \[2, 4\], checkpoint \[4\]"):
        rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).restore()
    assert torch.equal(model.weight, before)


# ---------------------------------------------------------------- 9. verifies, cannot load


def test_a_header_claiming_8_gib_is_refused_and_the_previous_checkpoint_used(tmp_path):
    weights = two_checkpoints(tmp_path)
    claim_huge_header(tmp_path / "checkpoint-4")
    assert verify(tmp_path / "checkpoint-4", Level.FULL).ok
    with pytest.raises(CorruptCheckpoint, match="header length 8589934592 does not fit"):
        restored(tmp_path, tmp_path / "checkpoint-4")
    step, model = restored(tmp_path)
    assert step == 2 and torch.equal(model.weight, weights[2])


@pytest.mark.parametrize("how", ["omitted", "symlinked"])
def test_state_json_must_be_listed(tmp_path, how):
    weights = two_checkpoints(tmp_path)
    ckpt = tmp_path / "checkpoint-4"
    m = manifest(ckpt)
    del m["files"]["state.json"]
    (ckpt / "manifest.json").write_text(json.dumps(m))
    if how == "symlinked":
        (ckpt / "state.json").unlink()
        (ckpt / "state.json").symlink_to("/etc/passwd")
    assert verify(ckpt, Level.FULL).ok
    with pytest.raises(CorruptCheckpoint) as e:
        restored(tmp_path, ckpt)
    assert "the manifest does not list state.json" in str(e.value)
    step, model = restored(tmp_path)
    assert step == 2 and torch.equal(model.weight, weights[2])


def test_a_listed_file_replaced_by_a_symlink_is_not_followed(tmp_path):
    two_checkpoints(tmp_path)
    ckpt = tmp_path / "checkpoint-4"
    (ckpt / "elsewhere.json").write_bytes((ckpt / "state.json").read_bytes())
    (ckpt / "state.json").unlink()
    (ckpt / "state.json").symlink_to("elsewhere.json")  # inside: verification allows it
    with pytest.raises(CorruptCheckpoint, match=r"cannot open state\.json"):
        restored(tmp_path, ckpt)
