"""Save at the failure (worker/saving/failsave.py), in this process: the decision by table, the
marks each kind of change leaves, and `Checkpointer.save_on_failure` committing exactly the last
completed step, or nothing."""

from __future__ import annotations

import dataclasses
import json
import random
import time
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.worker.saving import failsave
from rtrain.worker.saving.capture import moving
from rtrain.worker.saving.failsave import Marks, Verdict, decide

M = Marks(optimizer_steps=3, versions=(1, 2), scheduler=(3, 0.1), scaler=7)


@pytest.mark.parametrize("exc, boundary, now, committed, dist, verdict", [
    (RuntimeError("x"), 5, M, {4}, False, Verdict.SAVE),
    (torch.OutOfMemoryError("x"), 5, M, set(), False, Verdict.SAVE),
    # A newer checkpoint of an attempt this one did not resume from (damaged or set aside):
    # the boundary is what the relaunch needs.
    (RuntimeError("x"), 5, M, {4, 8}, False, Verdict.SAVE),
    (KeyboardInterrupt(), 5, M, {4}, False, Verdict.NOT_A_CRASH),
    (SystemExit(1), 5, M, {4}, False, Verdict.NOT_A_CRASH),
    (RuntimeError("x"), 5, M, {4}, True, Verdict.DISTRIBUTED),
    (RuntimeError("x"), None, M, {4}, False, Verdict.NO_BOUNDARY),
    (RuntimeError("x"), 5, M, {4, 5}, False, Verdict.ALREADY_SAVED),
    (RuntimeError("x"), 5, Marks(4, (1, 2), (3, 0.1), 7), {4}, False, Verdict.OPTIMIZER_STEPPED),
    (RuntimeError("x"), 5, Marks(3, (1, 3), (3, 0.1), 7), {4}, False, Verdict.MODEL_CHANGED),
    (RuntimeError("x"), 5, Marks(3, (1, 2), (4, 0.1), 7), {4}, False,
     Verdict.SCHEDULER_STEPPED),
    (RuntimeError("x"), 5, Marks(3, (1, 2), (3, 0.05), 7), {4}, False,
     Verdict.SCHEDULER_STEPPED),
    (RuntimeError("x"), 5, Marks(3, (1, 2), (3, 0.1), 8), {4}, False, Verdict.SCALER_UPDATED),
])
def test_decide(exc, boundary, now, committed, dist, verdict):
    assert decide(exc, boundary=boundary, at_boundary=M if boundary else None, now=now,
                  committed=committed, distributed=dist) is verdict


class HalfStep(torch.optim.SGD):
    """Updates the first parameter, then fails: a half-applied step."""

    def step(self, closure=None):
        with torch.no_grad():
            p = self.param_groups[0]["params"][0]
            p.add_(p.grad, alpha=-0.1)
        raise RuntimeError("failed half-way through the optimizer step")


def _setup(tmp_path, opt_cls=torch.optim.AdamW, every=100, **saving):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3),
                          nn.Linear(16, 3))
    opt = opt_cls(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = rtrain.ResumableSampler(len(ds), seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=sampler,
                               ckpt_dir=tmp_path / "ck", every=every,
                               saving=rtrain.Saving(**saving))
    return model, opt, sched, iter(loader), ckpt


def _forward(model, batches):
    x, y = next(batches)
    x = x + 1e-3 * (random.random() + float(np.random.rand()))
    return nn.functional.cross_entropy(model(x), y)


def _steps(model, opt, sched, batches, ckpt, n):
    for step in range(1, n + 1):
        loss = _forward(model, batches)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ckpt.maybe_save(step)


def _live(model, opt, sched, sampler_pos):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": opt.state_dict(), "sched": sched.state_dict(), "data": sampler_pos,
            "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())}


def test_an_exception_in_the_forward_commits_the_last_completed_step(tmp_path):
    model, opt, sched, batches, ckpt = _setup(tmp_path)
    _steps(model, opt, sched, batches, ckpt, 3)
    expected = _live(model, opt, sched, ckpt.data.sampler.state_dict())
    model[1].eval()  # BatchNorm would write its statistics in a training-mode forward
    loss = _forward(model, batches)  # step 4 consumes a batch and draws from every generator
    loss.backward()
    path = ckpt.save_on_failure(torch.OutOfMemoryError("CUDA out of memory (simulated)"))
    assert path is not None and path.name == "checkpoint-3"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["info"]["saved_at_failure"] is True
    assert manifest["info"]["failure"] == "OutOfMemoryError"

    model2, opt2, sched2, _, ckpt2 = _setup(tmp_path / "c")
    ckpt2.ckpt_dir = path.parent
    assert ckpt2.restore() == 3
    model2.train()
    got = _live(model2, opt2, sched2, ckpt2.data.sampler.state_dict())
    from bitwise import assert_bitwise_equal

    assert_bitwise_equal({k: v for k, v in got.items() if k != "rng"},
                         {k: v for k, v in expected.items() if k != "rng"})
    assert torch.equal(got["rng"][0], expected["rng"][0])
    assert got["rng"][1] == expected["rng"][1]
    assert np.array_equal(got["rng"][2], expected["rng"][2])


def test_an_exception_inside_optimizer_step_commits_nothing(tmp_path):
    model, opt, _, batches, ckpt = _setup(tmp_path, opt_cls=HalfStep)
    model.eval()
    for step in (1, 2):
        _forward(model, batches).backward()
        ckpt.maybe_save(step)
    loss = _forward(model, batches)
    loss.backward()
    with pytest.raises(RuntimeError, match="half-way") as e:
        opt.step()
    assert ckpt.save_on_failure(e.value) is None
    assert list_checkpoints(tmp_path / "ck") == []


@pytest.mark.parametrize("change", ["sched", "buffer", "param", "scaler"])
def test_a_change_after_the_boundary_commits_nothing(tmp_path, change):
    model, opt, sched, _, ckpt = _setup(tmp_path)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))  # the scale exists from the first scale()
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                               ckpt_dir=tmp_path / "ck2", every=100)
    ckpt.maybe_save(1)
    if change == "sched":
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
            warnings.simplefilter("ignore")
            sched.step()
    elif change == "buffer":
        model.train()
        model(torch.randn(4, 8))  # BatchNorm's running statistics
    elif change == "param":
        with torch.no_grad():
            model[0].weight.clamp_(-0.1, 0.1)
    else:
        scaler.update(new_scale=1024.0)
    assert ckpt.save_on_failure(RuntimeError("x")) is None
    assert list_checkpoints(tmp_path / "ck2") == []


def test_nothing_when_the_boundary_is_committed_or_the_exit_was_asked_for(tmp_path):
    *_, ckpt = _setup(tmp_path)
    assert ckpt.save_on_failure(RuntimeError("before any step")) is None
    ckpt.maybe_save(1)
    assert ckpt.save_on_failure(KeyboardInterrupt()) is None
    ckpt.save(1)
    assert ckpt.save_on_failure(RuntimeError("x")) is None
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [1]


def test_off_when_asked(tmp_path):
    *_, ckpt = _setup(tmp_path, on_failure=False)
    ckpt.maybe_save(1)
    assert ckpt.save_on_failure(RuntimeError("x")) is None
    assert list_checkpoints(tmp_path / "ck") == []


def test_a_failing_or_hanging_save_never_raises(tmp_path, monkeypatch, caplog):
    *_, ckpt = _setup(tmp_path)
    ckpt.maybe_save(1)

    def broken(cap):
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt, "_write", broken)
    assert ckpt.save_on_failure(RuntimeError("x")) is None
    assert "disk on fire" in caplog.text

    ckpt.saving = dataclasses.replace(ckpt.saving, failure_timeout_s=0.3)
    monkeypatch.setattr(ckpt, "_write", lambda cap: time.sleep(5))
    t0 = time.monotonic()
    assert ckpt.save_on_failure(RuntimeError("y")) is None
    assert time.monotonic() - t0 < 3
    assert "did not finish in" in caplog.text


@pytest.mark.parametrize("mode", ["thread", pytest.param("fork", marks=pytest.mark.slow)])
def test_waits_for_a_save_in_flight_then_saves_a_newer_boundary(tmp_path, mode):
    *_, ckpt = _setup(tmp_path, every=3, async_mode=mode)
    for step in range(1, 5):
        ckpt.maybe_save(step)  # step 3 starts a background save
    path = ckpt.save_on_failure(RuntimeError("x"))
    assert path is not None and path.name == "checkpoint-4"
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [4, 3]
    # The failure came with the boundary's own save in flight: that one is waited for.
    *_, ckpt = _setup(tmp_path / "b", every=3, async_mode=mode)
    for step in range(1, 4):
        ckpt.maybe_save(step)
    assert ckpt.save_on_failure(RuntimeError("x")) is None
    assert [s for s, _ in list_checkpoints(tmp_path / "b" / "ck")] == [3]


def test_what_a_boundary_keeps_costs_microseconds():
    # ~100 parameters and buffers, as a small transformer has.
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32))
                            for _ in range(25)])
    opt = torch.optim.AdamW(model.parameters())
    sampler = rtrain.ResumableSampler(100, seed=1)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, loader=sampler, every=10**9)
    watch, parts = failsave.Watch(model, opt, None, None), ckpt._parts()
    watch.marks()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        watch.marks()
        moving(parts)
    per_step = (time.perf_counter() - t0) / n
    # ~60 us unloaded; the bound leaves room for a shared machine, not for a walk of the model.
    assert per_step < 2e-3, per_step
