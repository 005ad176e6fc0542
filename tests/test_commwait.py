"""The wait inside DDP's gradient all-reduce (worker/commwait.py): the timing by a scripted
clock and hand-completed futures, and the hook on a real DDP model in a one-rank gloo group
(the script's own hook, registered before or after the Checkpointer). Four real ranks, one slow
in its compute, are tests/test_dist_straggler.py's."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch
from harness import CHILDREN, child_env
from torch import nn

import rtrain
from rtrain.worker.commwait import CommWaits, install


class Bucket:
    def __init__(self, last: bool) -> None:
        self.last = last

    def is_last(self) -> bool:
        return self.last


class Timed:
    """A CommWaits on a scripted clock, its inner hook handing out futures the test completes."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits = CommWaits(None, None, clock=lambda: self.now)

    def launched(self, at: float, bucket: Bucket):
        """The timed hook's future for `bucket`, launched at `at`, and the inner future that
        completes it."""
        inner: torch.futures.Future = torch.futures.Future()
        self.waits.inner = lambda state, b: inner
        self.now = at
        return self.waits.hook(None, bucket), inner

    def complete(self, at: float, inner, value=None) -> None:
        self.now = at
        inner.set_result(torch.zeros(1) if value is None else value)


@pytest.fixture
def t():
    return Timed()


def test_the_wait_runs_from_the_last_bucket_launched_to_the_last_completed(t):
    # Bucket 0's collective overlaps the rest of the backward: not a wait. After the last
    # bucket is launched (t=2.0) the rank only waits, until the last completion (t=2.3).
    _, b0 = t.launched(1.0, Bucket(last=False))
    _, b1 = t.launched(2.0, Bucket(last=True))
    t.complete(1.5, b0)
    assert t.waits.take() == 0.0  # the backward's buckets are not all done yet
    t.complete(2.3, b1)
    assert t.waits.take() == pytest.approx(0.3)
    assert t.waits.take() == 0.0  # taken


def test_buckets_completing_out_of_order_count_once_all_are_done(t):
    _, b0 = t.launched(1.0, Bucket(last=False))
    _, b1 = t.launched(1.2, Bucket(last=True))
    t.complete(1.4, b1)
    assert t.waits.take() == 0.0
    t.complete(1.7, b0)
    assert t.waits.take() == pytest.approx(0.5)


def test_waits_add_up_over_backwards_until_taken(t):
    for start in (0.0, 10.0):
        _, b = t.launched(start, Bucket(last=True))
        t.complete(start + 0.25, b)
    assert t.waits.take() == pytest.approx(0.5)


def test_the_inner_hooks_result_and_failure_reach_ddp(t):
    fut, b = t.launched(0.0, Bucket(last=True))
    t.complete(0.1, b, torch.ones(3))
    assert torch.equal(fut.wait(), torch.ones(3))
    fut, b = t.launched(1.0, Bucket(last=True))
    b.set_exception(RuntimeError("connection reset by peer"))
    with pytest.raises(RuntimeError, match="connection reset"):
        fut.wait()


def _ddp():
    torch.manual_seed(0)
    return nn.parallel.DistributedDataParallel(nn.Linear(8, 2))


def _backward(model) -> None:
    model(torch.randn(4, 8)).sum().backward()


def test_a_ddp_model_handed_to_the_checkpointer_is_timed(gloo_group, tmp_path):
    model, plain = _ddp(), _ddp()
    ckpt = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "c")
    assert ckpt._comm is not None
    torch.manual_seed(1)
    _backward(model)
    torch.manual_seed(1)
    _backward(plain)
    # DDP's own mean, through rtrain's hook: the same gradients as without it.
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert ckpt._comm._pending == 0 and ckpt._comm.take() >= 0.0


def test_the_scripts_hook_registered_later_runs_timed(gloo_group, tmp_path):
    model = _ddp()
    ckpt = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "c")
    seen = []

    def doubled(state, bucket):
        seen.append(state)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut

    model.register_comm_hook("mine", doubled)  # DDP alone would refuse a second hook
    _backward(model)
    assert seen == ["mine"]
    assert ckpt._comm.inner is doubled and ckpt._comm.state == "mine"
    # A later Checkpointer of the same model reads the same waits, the script's hook kept.
    again = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "c")
    assert again._comm is ckpt._comm and again._comm.inner is doubled


def test_a_hook_registered_before_the_checkpointer_is_left_alone_and_said(gloo_group, tmp_path,
                                                                          caplog):
    model = _ddp()
    seen = []

    def mine(state, bucket):
        seen.append(1)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    model.register_comm_hook(None, mine)
    with caplog.at_level(logging.WARNING, logger="rtrain.worker.commwait"):
        ckpt = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "c")
    assert ckpt._comm is None
    assert "comm hook already (" in caplog.text and "mine" in caplog.text
    assert "register the hook after creating the Checkpointer" in caplog.text
    _backward(model)
    assert seen == [1]


def test_a_built_in_hook_registered_before_is_left_alone_and_said(gloo_group, tmp_path, caplog):
    model = _ddp()
    model._register_builtin_comm_hook(torch.distributed.BuiltinCommHookType.ALLREDUCE)
    with caplog.at_level(logging.WARNING, logger="rtrain.worker.commwait"):
        ckpt = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "c")
    assert ckpt._comm is None and "DDP took no comm hook" in caplog.text
    _backward(model)  # training goes on with DDP's own


def test_only_ddp_models_are_timed(gloo_group):
    assert install(nn.Linear(2, 2)) is None
    assert install(None) is None


@pytest.mark.slow
def test_three_ranks_get_the_gradients_ddp_makes_without_the_hook_bit_for_bit(tmp_path):
    # Three ranks: a mean by 1/3 rounds, so dividing instead of multiplying as DDP's built-in
    # reduction does would differ in the last bit (torch's allreduce_hook does).
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        "--standalone", str(CHILDREN / "ddp_grads.py")], cwd=tmp_path,
                       env=child_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # The ranks share torchrun's stdout: one rank's line may land inside another's.
    said = sorted(re.findall(r"rank \d: (?:equal|differ by \S+?)(?=rank|\s|$)", r.stdout))
    assert said == ["rank 0: equal", "rank 1: equal", "rank 2: equal"], r.stdout
