"""Real faults against the worker: SIGKILL at random points of a save, a full filesystem."""

import errno
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import CHILDREN, child_env
from torch import nn

import rtrain
from rtrain.checkpoint.layout import list_checkpoints, list_leftovers
from rtrain.checkpoint.verify import select_rtrain_resume, verify_all


@pytest.mark.slow
# Each kill starts a torch process; the torch-free commit layer below takes 30 kills by default.
@pytest.mark.parametrize("kills", [3, pytest.param(12, marks=pytest.mark.soak)])
def test_sigkill_during_saves_never_leaves_a_bad_pick(tmp_path, kills):
    """Kill a saving process at many random moments; whatever resume picks must load and be
    one consistent state (every weight equal to the checkpoint's step)."""
    rng = random.Random(1)
    env = child_env()
    env.pop("RTRAIN_RUN_DIR", None)
    for _ in range(kills):
        proc = subprocess.Popen([sys.executable, str(CHILDREN / "save_forever.py"),
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        sel = select_rtrain_resume(tmp_path)
        assert sel.chosen is not None
        step = sel.chosen.step
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
        opt = torch.optim.Adam(model.parameters())
        ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
        assert ck.restore() == step
        assert all(torch.all(p == float(step)) for p in model.parameters())
    # Only committed checkpoints are ever listed; leftovers are temp dirs, never loaded.
    assert all(v.ok for v in verify_all(tmp_path, "full"))


@pytest.mark.slow
def test_sigkill_at_many_points_of_the_commit_protocol(tmp_path):
    """The same with the torch-free commit layer, which starts fast enough for many kills."""
    from safetensors.numpy import load_file

    rng = random.Random(2)
    env = child_env()
    for _ in range(30):
        proc = subprocess.Popen([sys.executable, str(CHILDREN / "commit_forever.py"),
                                 str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.08))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        sel = select_rtrain_resume(tmp_path)
        if sel.chosen is None:
            assert list_checkpoints(tmp_path) == []
            continue
        step = sel.chosen.step
        for i in range(4):
            data = load_file(sel.chosen.path / f"part{i}.safetensors")["t"]
            assert data.shape == (1 << 20,) and (data == step % 251).all()
    assert len(list_checkpoints(tmp_path)) > 5


@pytest.fixture
def small_fs(small_tmpfs):
    return small_tmpfs("3m")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))  # ~0.5 MB of weights


def test_full_disk_skips_saves_and_keeps_old_checkpoints(small_fs, caplog):
    model = _model()
    ck = rtrain.Checkpointer(model=model, ckpt_dir=small_fs, keep=None)
    with caplog.at_level(logging.WARNING):
        saved = [ck.save(step) for step in range(1, 9)]
    assert saved[0] is not None and saved[-1] is None  # the disk ran out on the way
    assert ck.skipped_saves >= 1
    assert "skipping this checkpoint" in caplog.text
    assert all(v.ok for v in verify_all(small_fs, "full"))
    assert list_leftovers(small_fs) == []


def test_enospc_mid_save_keeps_training(small_fs, monkeypatch, caplog):
    model = _model()
    ck = rtrain.Checkpointer(model=model, ckpt_dir=small_fs, keep=None)
    assert ck.save(1) is not None
    # Another writer fills the disk between the free-space check and the write.
    monkeypatch.setattr("rtrain.worker.saving.retention.free_bytes", lambda p: 1 << 40)
    ballast = small_fs / "ballast"
    free = shutil.disk_usage(small_fs).free
    with open(ballast, "wb") as f:
        f.write(b"\0" * (free - 200_000))
    with caplog.at_level(logging.WARNING):
        assert ck.save(2) is None
    assert f"not saved ({os.strerror(errno.ENOSPC)})" in caplog.text
    assert [s for s, _ in list_checkpoints(small_fs)] == [1]
    assert list_leftovers(small_fs) == []
    assert all(v.ok for v in verify_all(small_fs, "full"))
    ballast.unlink()
    assert ck.save(3) is not None  # space is back: saving resumes


def test_batch_size_change_resumes_at_the_exact_next_sample(tmp_path):
    """Position is kept in samples: a halved batch size sees every sample once per epoch."""
    from torch.utils.data import DataLoader

    n = 40
    seen = []
    sampler = rtrain.ResumableSampler(n, seed=3)
    ck = rtrain.Checkpointer(loader=sampler, ckpt_dir=tmp_path)
    loader = DataLoader(list(range(n)), batch_size=8, sampler=sampler)
    for i, batch in enumerate(loader):
        seen += batch.tolist()
        if i == 2:
            ck.save(3)
            break
    sampler2 = rtrain.ResumableSampler(n, seed=3)
    rtrain.Checkpointer(loader=sampler2, ckpt_dir=tmp_path).restore()
    for batch in DataLoader(list(range(n)), batch_size=4, sampler=sampler2):
        seen += batch.tolist()
    assert sorted(seen) == list(range(n))
    assert sampler2.epoch == 1 and sampler2.samples_seen == n
