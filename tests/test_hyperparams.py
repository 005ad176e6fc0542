"""Optimizer hyper-parameters a restore replaced (worker/trainstate/hyperparams.py): one warning
line per resume for what the script changed, none for what it sets itself every step. Real torch
optimizers and schedulers, in-process; the pure parts by table."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import rtrain
from rtrain.worker.trainstate.hyperparams import Change, describe, split

pytestmark = pytest.mark.usefixtures("unsupervised")
HEAD = "optimizer hyper-parameters differ from the script's and the checkpoint's values are used: "


def model_and_groups(seed: int = 0) -> tuple[nn.Module, list[dict]]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return model, [{"params": model[0].parameters()}, {"params": model[2].parameters()}]


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def saved(tmp_path, **opt_kw) -> None:
    """A checkpoint at step 3 of a two-group AdamW run."""
    model, groups = model_and_groups()
    opt = torch.optim.AdamW(groups, **{"lr": 1e-3, "weight_decay": 0.0, **opt_kw})
    for _ in range(3):
        step(model, opt)
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).save(3)


def lines(caplog, level: int) -> list[str]:
    """What any logger said about hyper-parameters at `level`."""
    return [r.getMessage() for r in caplog.records
            if r.levelno == level and "hyper-parameter" in r.getMessage()]


def test_a_value_changed_in_the_script_is_one_warning_after_an_iteration(tmp_path, caplog):
    saved(tmp_path)
    model, groups = model_and_groups(1)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)  # the person changed it
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        assert ck.restore() == 3
        assert lines(caplog, logging.WARNING) == []     # the verdict waits for the script
        for s in range(3, 6):
            step(model, opt)
            ck.maybe_save(s + 1)
        ck.close()
    assert lines(caplog, logging.WARNING) == [
        HEAD + "'weight_decay' of all groups: script 0.1, checkpoint 0.0"]
    assert lines(caplog, logging.INFO) == []
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)  # the checkpoint's is used


@pytest.mark.parametrize("where", ["before the step", "after the save"])
def test_a_learning_rate_the_script_sets_every_step_is_no_warning(tmp_path, caplog, where):
    """The single-file script's idiom: lr computed from the iteration and written into every
    group, before the step or at the end of the iteration."""
    saved(tmp_path)

    def get_lr(it: int) -> float:
        return 6e-4 * 0.9**it

    model, groups = model_and_groups(1)
    opt = torch.optim.AdamW(groups, lr=6e-4, weight_decay=0.0)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        start = ck.restore()
        for it in range(start, start + 4):
            if where == "before the step":
                for g in opt.param_groups:
                    g["lr"] = get_lr(it)
            step(model, opt)
            ck.maybe_save(it + 1)
            if where == "after the save":
                for g in opt.param_groups:
                    g["lr"] = get_lr(it + 1)
        ck.close()
    assert lines(caplog, logging.WARNING) == []
    assert lines(caplog, logging.INFO) == [
        "optimizer hyper-parameters the script sets itself after the restore (the "
        "checkpoint's values were replaced): 'lr' of all groups: script 0.0006, "
        "checkpoint 0.001"]


def test_everything_that_differs_is_one_line(tmp_path, caplog):
    saved(tmp_path)
    model, groups = model_and_groups(1)
    groups[1]["lr"], groups[1]["betas"] = 5e-4, (0.8, 0.95)
    opt = torch.optim.AdamW(groups, lr=2e-3, weight_decay=0.0, eps=1e-6)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        ck.restore()
        for s in range(3, 5):
            step(model, opt)
            ck.maybe_save(s + 1)
    assert lines(caplog, logging.WARNING) == [
        HEAD + "'lr' of group 0: script 0.002, checkpoint 0.001; 'lr' of group 1: script "
        "0.0005, checkpoint 0.001; 'eps' of all groups: script 1e-06, checkpoint 1e-08; "
        "'betas' of group 1: script (0.8, 0.95), checkpoint (0.9, 0.999)"]


def test_under_a_scheduler_the_initial_lr_is_judged(tmp_path, caplog):
    """The scheduler moves lr at every step; a new initial lr in the script still warns."""
    def build(lr: float):
        model, groups = model_and_groups()
        opt = torch.optim.SGD(groups, lr=lr)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)

    model, opt, sched = build(0.1)
    step(model, opt)
    sched.step()
    rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, ckpt_dir=tmp_path).save(1)
    model, opt, sched = build(0.2)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, ckpt_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        ck.restore()
        for s in range(1, 4):
            step(model, opt)
            sched.step()
            ck.maybe_save(s + 1)
    assert lines(caplog, logging.WARNING) == [
        HEAD + "'initial_lr' of all groups: script 0.2, checkpoint 0.1"]


def test_a_script_that_stops_before_its_steps_hears_it_at_close(tmp_path, caplog):
    saved(tmp_path)
    model, groups = model_and_groups(1)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        ck.restore()
        step(model, opt)                                  # one step: no verdict yet
        assert lines(caplog, logging.WARNING) == []
        ck.close()
        ck.close()
    assert len(lines(caplog, logging.WARNING)) == 1


def test_nothing_changed_nothing_said(tmp_path, caplog):
    saved(tmp_path)
    model, groups = model_and_groups(1)
    opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.0)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path)
    with caplog.at_level(logging.INFO):
        ck.restore()
        for _ in range(3):
            step(model, opt)
        ck.close()
    assert lines(caplog, logging.WARNING) == lines(caplog, logging.INFO) == []


LR0, LR1 = Change(0, "lr", 2e-3, 1e-3), Change(1, "lr", 2e-3, 1e-3)
WD1 = Change(1, "weight_decay", 0.1, 0.0)


@pytest.mark.parametrize("changes, n, text", [
    ([LR0, LR1], 2, "'lr' of all groups: script 0.002, checkpoint 0.001"),
    ([LR0], 1, "'lr' of group 0: script 0.002, checkpoint 0.001"),
    ([LR0], 2, "'lr' of group 0: script 0.002, checkpoint 0.001"),
    ([LR0, LR1, WD1], 3, "'lr' of groups 0, 1: script 0.002, checkpoint 0.001; "
                         "'weight_decay' of group 1: script 0.1, checkpoint 0.0"),
    ([LR0, Change(1, "lr", 3e-3, 1e-3)], 2,
     "'lr' of group 0: script 0.002, checkpoint 0.001; 'lr' of group 1: script 0.003, "
     "checkpoint 0.001"),
    ([Change(0, "lr", torch.tensor(0.5), torch.tensor(0.25))], 1,
     "'lr' of group 0: script 0.5, checkpoint 0.25"),
])
def test_describe(changes, n, text):
    assert describe(changes, n) == text


@pytest.mark.parametrize("restored, current, managed", [
    ({(0, "lr"): 1e-3, (1, "lr"): 1e-3}, {(0, "lr"): 1e-3, (1, "lr"): 1e-3}, []),
    ({(0, "lr"): 1e-3, (1, "lr"): 1e-3}, {(0, "lr"): 5e-4, (1, "lr"): 1e-3}, [LR0]),
    ({(0, "lr"): 1e-3, (1, "lr"): 1e-3}, {(0, "lr"): 2e-3, (1, "lr"): 7e-4}, [LR0, LR1]),
    # a tensor lr written in place counts as set
    ({(0, "lr"): torch.tensor(1e-3), (1, "lr"): 1e-3},
     {(0, "lr"): torch.tensor(2e-3), (1, "lr"): 1e-3}, [LR0]),
])
def test_split(restored, current, managed):
    standing, got = split([LR0, LR1], restored, current)
    assert got == managed and standing == [c for c in (LR0, LR1) if c not in managed]
