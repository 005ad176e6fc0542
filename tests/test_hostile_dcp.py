"""Sharded (DCP) checkpoints under a real process group (gloo, world size 1): they still load,
without DCP's unpickling reader, and a code-running `.metadata` is refused."""

from __future__ import annotations

import logging

import pytest
import torch
from hostile import code_running_pickle, make, relist, two_checkpoints

import rtrain
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.errors import CorruptCheckpoint

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


def sharded_checkpoints(ckpt_dir):
    return two_checkpoints(ckpt_dir, saving=rtrain.Saving(sharded=True))


def restore(ckpt_dir, path=None, allow_pickle=False, **kw):
    model, opt = make(7)
    step = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir,
                               saving=rtrain.Saving(sharded=True),
                               restoring=rtrain.Restoring(allow_pickle=allow_pickle),
                               **kw).restore(path)
    return step, model, opt


@pytest.mark.slow
def test_sharded_checkpoints_load_without_unpickling(gloo_group, tmp_path, monkeypatch):
    import pickle

    weights, opt = sharded_checkpoints(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "checkpoint-4" / "dcp" / ".metadata").exists()

    def refuse(*a, **kw):
        raise AssertionError("pickle.load was called on a checkpoint file")

    monkeypatch.setattr(pickle, "load", refuse)  # DCP's own reader calls pickle.load
    step, model, opt2 = restore(tmp_path / "ckpt")
    assert step == 4 and torch.equal(model.weight, weights[4])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"],
                       opt.state_dict()["state"][0]["exp_avg"])


def test_code_in_dcp_metadata_is_refused_under_a_process_group(gloo_group, tmp_path, caplog):
    weights, _ = sharded_checkpoints(tmp_path / "ckpt")
    bad = tmp_path / "ckpt" / "checkpoint-4"
    marker = tmp_path / "PWNED"
    relist(bad, "dcp/.metadata", code_running_pickle(marker))
    assert verify(bad, Level.FULL).ok
    try:
        with pytest.raises(CorruptCheckpoint, match=r"builtins\.exec, which is not part of "
                                                    "DCP's metadata"):
            restore(tmp_path / "ckpt")
    finally:
        assert not marker.exists(), "restore() ran code from the checkpoint"
    step, model, _ = restore(tmp_path / "ckpt", tmp_path / "ckpt" / "checkpoint-2")
    assert step == 2 and torch.equal(model.weight, weights[2])


def test_allow_pickle_is_an_explicit_loud_opt_in(gloo_group, tmp_path, caplog):
    weights, _ = sharded_checkpoints(tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING):
        step, model, _ = restore(tmp_path / "ckpt", allow_pickle=True)
    assert step == 4 and torch.equal(model.weight, weights[4])
    assert "UNPICKLES" in caplog.text
