"""The Checkpointer in-process: what it captures, the messages it gives, schedules, retention."""

import json
import logging

import pytest
import torch
from torch import nn

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import verify
from rtrain.supervisor.core.errors import CheckpointError, CorruptCheckpoint, StateMismatch
from rtrain.worker.saving import cadence


def make(seed=0, width=8):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt


def train_steps(model, opt, n):
    for _ in range(n):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


pytestmark = pytest.mark.usefixtures("unsupervised")


def test_fresh_start_returns_zero(tmp_path):
    model, opt = make()
    assert rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).restore() == 0


def test_round_trip_model_optimizer_scaler_extras(tmp_path):
    model, opt = make()
    train_steps(model, opt, 3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, scaler=scaler, ckpt_dir=tmp_path)
    extra = {"best": 0.5, "names": ("a", "b"), "table": torch.arange(5), "nested": {"k": [1]}}
    path = ck.save(3, metrics={"loss": 1.25}, extra=extra)
    assert verify(path).ok
    m = json.loads((path / "manifest.json").read_text())
    assert m["metrics"] == {"loss": 1.25} and m["step"] == 3
    assert "0.weight/exp_avg" in m["tensors"]["optimizer.safetensors"]

    model2, opt2 = make(seed=99)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0)
    ck2 = rtrain.Checkpointer(model=model2, optimizer=opt2, scaler=scaler2, ckpt_dir=tmp_path)
    assert ck2.restore() == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for i in s1:
        for k in s1[i]:
            assert torch.equal(s1[i][k], s2[i][k])
    assert scaler2.get_scale() == 1024.0
    assert ck2.extra["names"] == ("a", "b") and torch.equal(ck2.extra["table"], torch.arange(5))
    assert ck2.extra["nested"] == {"k": [1]} and ck2.extra["best"] == 0.5


def test_shape_mismatch_names_the_layer(tmp_path):
    model, opt = make(width=8)
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).save(1)
    other, opt2 = make(width=6)
    with pytest.raises(StateMismatch) as e:
        rtrain.Checkpointer(model=other, optimizer=opt2, ckpt_dir=tmp_path).restore()
    assert "layer '0.weight' shape mismatch: model [6, 4], checkpoint [8, 4]" in str(e.value)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    model, _ = make()
    rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2))
    del other[0]
    with pytest.raises(StateMismatch) as e:
        rtrain.Checkpointer(model=other, ckpt_dir=tmp_path).restore()
    msg = str(e.value)
    assert "missing from the checkpoint" in msg and "unexpected in the checkpoint" in msg


def test_corrupt_newest_falls_back_with_reason(tmp_path, caplog):
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path, keep=5)
    ck.save(1)
    newest = ck.save(2)
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    model2, opt2 = make()
    with caplog.at_level(logging.WARNING):
        assert rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path).restore() == 1
    assert "skipping checkpoint-2: corrupt: file 'model.safetensors' content hash" in caplog.text


def test_explicit_bad_path_is_refused(tmp_path):
    model, _ = make()
    p = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    (p / "state.json").write_text("{}")
    with pytest.raises(CorruptCheckpoint, match=r"state\.json"):
        rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore(p)


def test_supervised_without_resume_from_starts_fresh(tmp_path, monkeypatch):
    model, _ = make()
    rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(5)
    monkeypatch.setenv("RTRAIN_RUN_DIR", str(tmp_path))
    assert rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore() == 0
    monkeypatch.setenv("RTRAIN_RESUME_FROM", str(tmp_path / "checkpoint-5"))
    assert rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore() == 5


def test_signed_checkpoints(tmp_path, monkeypatch):
    model, _ = make()
    monkeypatch.setenv("RTRAIN_SIGNING_KEY", "s3cret")
    rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    assert rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore() == 1
    monkeypatch.setenv("RTRAIN_SIGNING_KEY", "another")
    assert rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore() == 0  # nothing trusted


def test_trainable_only_checks_the_frozen_base(tmp_path):
    model, _ = make()
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                          momentum=0.9)
    train_steps(model, opt, 2)
    adapters = rtrain.Saving(trainable_only=True)
    p = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                            saving=adapters).save(2)
    saved = json.loads((p / "manifest.json").read_text())["tensors"]["model.safetensors"]
    assert set(saved) == {"2.weight", "2.bias"}
    same_base, _ = make()
    for q in list(same_base.parameters())[:2]:
        q.requires_grad_(False)
    opt2 = torch.optim.SGD([q for q in same_base.parameters() if q.requires_grad], lr=0.1,
                           momentum=0.9)
    assert rtrain.Checkpointer(model=same_base, optimizer=opt2, ckpt_dir=tmp_path,
                               saving=adapters).restore() == 2
    assert torch.equal(same_base[2].weight, model[2].weight)
    other_base, _ = make(seed=5)
    for q in list(other_base.parameters())[:2]:
        q.requires_grad_(False)
    with pytest.raises(StateMismatch, match="frozen base model differs"):
        rtrain.Checkpointer(model=other_base, ckpt_dir=tmp_path, saving=adapters).restore()


def test_schedules_and_retention(tmp_path):
    model, _ = make()
    ck = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path, every=2,
                             keep=rtrain.Keep(last=2, best=1, metric="loss", mode="min",
                                              milestone_every=8))
    losses = {2: 0.1, 4: 0.9, 6: 0.8, 8: 0.7, 10: 0.6, 12: 0.5}
    for step in range(1, 13):
        ck.maybe_save(step, metrics={"loss": losses.get(step, 1.0)})
    steps = sorted(s for s, _ in list_checkpoints(tmp_path))
    assert steps == [2, 8, 10, 12]  # best (2), milestone (8), newest two (10, 12)


def test_epoch_end_and_request(tmp_path):
    model, _ = make()
    ck = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path, every=rtrain.Every(epoch_end=True),
                             keep=None)
    assert ck.maybe_save(1) is None
    assert ck.maybe_save(2, epoch_end=True) is not None
    ck.request_save()
    assert ck.maybe_save(3) is not None
    assert sorted(s for s, _ in list_checkpoints(tmp_path)) == [2, 3]


@pytest.mark.parametrize("async_save", [False, True])
def test_auto_cadence_follows_the_measured_save(tmp_path, async_save):
    """The first save comes at step 2, whatever the run's length, to measure its stall and the
    step time, which then choose the interval (async: the thread snapshot, not the write),
    within the bounds."""
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                             every="auto",
                             saving=rtrain.Saving(async_mode="thread" if async_save else "off"))
    assert ck.schedule.every_steps == cadence.FIRST_SAVE_STEPS
    for step in range(1, 6):
        train_steps(model, opt, 1)
        ck.maybe_save(step, metrics={"loss": 1.0 / step})
    ck.close()
    assert sorted(s for s, _ in list_checkpoints(tmp_path))[0] == 2
    chosen = ck._clock.cadence
    assert chosen is not None and chosen.mtbf_source == "prior"
    assert ck._clock.schedule.every_steps == chosen.every_steps
    assert chosen.save_stall_s > 0 and chosen.step_time_s > 0
    assert chosen.reason.startswith(f"every {chosen.every_steps:,} step")

    bounded = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "b", keep=None,
                                  every=rtrain.Every(steps="auto", min_steps=2, max_steps=3,
                                                     seconds=60.0))
    assert bounded.schedule.every_steps == 2  # first save at step 2 (min_steps 2)
    for step in range(1, 8):
        bounded.maybe_save(step)
    bounded.save(8)
    assert bounded._clock.schedule.every_steps in (2, 3)  # within the bounds, whatever it cost
    assert bounded._clock.schedule.every_seconds == 60.0


@pytest.mark.parametrize("mode", [pytest.param("fork", marks=pytest.mark.slow), "thread"])
def test_async_error_surfaces_on_next_call(tmp_path, monkeypatch, mode):
    model, _ = make()
    ck = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path,
                             saving=rtrain.Saving(async_mode=mode))

    def boom(*a, **k):
        raise RuntimeError("disk controller on fire")

    monkeypatch.setattr("rtrain.checkpoint.commit.PendingCheckpoint.commit", boom)
    ck.save(1)
    with pytest.raises(CheckpointError, match="disk controller on fire"):
        ck.close()
    assert list_checkpoints(tmp_path) == []
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("mode", [pytest.param("fork", marks=pytest.mark.slow), "thread"])
def test_async_snapshot_is_isolated_from_training(tmp_path, mode):
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                             saving=rtrain.Saving(async_mode=mode))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(1)
    train_steps(model, opt, 2)  # changes weights while the writer may still run
    ck.close()
    model2, _ = make(seed=3)
    rtrain.Checkpointer(model=model2, ckpt_dir=tmp_path).restore()
    for k, v in model2.state_dict().items():
        assert torch.equal(v, before[k])


def test_extra_rejects_non_json(tmp_path):
    ck = rtrain.Checkpointer(model=make()[0], ckpt_dir=tmp_path)
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        ck.save(1, extra={"f": object()})
    assert list_checkpoints(tmp_path) == []


def test_lr_scale_from_the_supervisor_applies_once(tmp_path, monkeypatch):
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, ckpt_dir=tmp_path).save(1)
    monkeypatch.setenv("RTRAIN_SETTINGS", '{"lr_scale": 0.5}')
    model2, opt2 = make()
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=10)
    ck = rtrain.Checkpointer(model=model2, optimizer=opt2, scheduler=sched2, ckpt_dir=tmp_path)
    ck.restore()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.5e-3)
    assert sched2.base_lrs == [pytest.approx(0.5e-3)]
    ck.save(2)
    model3, opt3 = make()  # same lr_scale again: the checkpoint already has it, no new cut
    rtrain.Checkpointer(model=model3, optimizer=opt3, ckpt_dir=tmp_path).restore()
    assert opt3.param_groups[0]["lr"] == pytest.approx(0.5e-3)



def test_environment_change_warns(tmp_path, caplog):
    model, _ = make()
    path = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    m = json.loads((path / "manifest.json").read_text())
    m["environment"]["torch"] = "1.13.1"
    (path / "manifest.json").write_text(json.dumps(m))
    with caplog.at_level(logging.WARNING):
        rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).restore()
    assert f"environment changed since the checkpoint: torch 1.13.1 -> {torch.__version__}" \
        in caplog.text
