"""A process group resuming from the memory tier's parts (worker/memtier/memory_resume.py), in this
process: a real gloo group of one rank, the real Checkpointer writing its parts and its disk
checkpoints, then a second Checkpointer resuming: from memory when the newest part is whole and
newer than the disk's, from the disk when a part does not read (a flipped byte) or the run is
another's. The two-rank and two-node cases are tests/test_dist_memtier.py's. (`gloo_group`
clears RTRAIN_*: it comes before `shm`, which sets the memory dir.)"""

from __future__ import annotations

import torch
from torch import nn

import rtrain
from rtrain.checkpoint import parts, runid
from rtrain.checkpoint.layout import checkpoint_name
from rtrain.supervisor.core.protocol import ENV_MEMORY_RESUME, ENV_RESUME_FROM

RUN = "3" * 32


def _train(ckpt_dir, steps: int) -> tuple[nn.Module, rtrain.Checkpointer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=3,
                             saving=rtrain.Saving(memory=1, async_mode="off"))
    for step in range(1, steps + 1):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.maybe_save(step)
    ck.close()
    return model, ck


def _resume(ckpt_dir) -> tuple[int, nn.Module]:
    torch.manual_seed(1)  # other weights: what a resume must replace
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=3)
    step = ck.restore()
    ck.close()
    return step, model


def _setup(tmp_path, shm, monkeypatch):
    ckpt_dir = tmp_path / "ck"
    ckpt_dir.mkdir()
    runid.write(ckpt_dir, RUN)
    runid.write(shm, RUN)  # rtrain copies the run identity into the memory dir
    trained, _ = _train(ckpt_dir, 5)  # disk at 3, parts at 4 and 5
    monkeypatch.setenv(ENV_RESUME_FROM, str(ckpt_dir / checkpoint_name(3)))
    monkeypatch.setenv(ENV_MEMORY_RESUME, "1")  # rtrain's pick was the newest (no rollback)
    return ckpt_dir, trained


def test_the_group_resumes_from_its_newest_whole_part(tmp_path, gloo_group, shm, monkeypatch):
    ckpt_dir, trained = _setup(tmp_path, shm, monkeypatch)
    assert sorted(p.step for p in parts.list_parts(shm, None)) == [4, 5]
    step, model = _resume(ckpt_dir)
    assert step == 5
    assert torch.equal(model.weight, trained.weight)


def test_a_part_that_does_not_read_sends_the_group_to_the_disk(tmp_path, gloo_group, shm,
                                                                monkeypatch, caplog):
    ckpt_dir, _ = _setup(tmp_path, shm, monkeypatch)
    bad = parts.rank_dir(shm, 0) / checkpoint_name(5) / "model.safetensors"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF  # a flipped byte, the size kept: the manifest's quick check passes
    bad.write_bytes(bytes(data))
    step, _ = _resume(ckpt_dir)
    assert step == 3  # the disk checkpoint rtrain picked, not the part of 4 or a half-read 5
    assert "did not load on every rank" in caplog.text and "content hash" in caplog.text


def test_another_runs_parts_are_never_resumed(tmp_path, gloo_group, shm, monkeypatch):
    ckpt_dir, _ = _setup(tmp_path, shm, monkeypatch)
    assert sorted(p.step for p in parts.list_parts(shm, None)) == [4, 5]
    runid.write(shm, "4" * 32)  # the memory dir now says another run: its parts are not ours
    step, _ = _resume(ckpt_dir)
    assert step == 3


def test_a_rollback_is_never_overridden_by_newer_parts(tmp_path, gloo_group, shm, monkeypatch):
    ckpt_dir, _ = _setup(tmp_path, shm, monkeypatch)
    monkeypatch.setenv(ENV_MEMORY_RESUME, "0")  # rtrain rolled back: the newer state is suspect
    step, _ = _resume(ckpt_dir)
    assert step == 3
