"""rtrain.worker.guards.degrade: non-finite skips, OOM back-off, bad samples, exit records of
uncaught errors."""

import json
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import rtrain
from rtrain.worker.guards import degrade


@pytest.fixture(autouse=True)
def status_dir(tmp_path, monkeypatch):
    """Supervised as far as exit records go; no overrides leak between tests."""
    monkeypatch.setenv("RTRAIN_STATUS", str(tmp_path))
    monkeypatch.delenv("RTRAIN_SETTINGS", raising=False)
    degrade._overrides.clear()
    yield tmp_path
    degrade._overrides.clear()


def record(status_dir):
    return json.loads((status_dir / "exit-rank0.json").read_text())


def model_and_grads(nan=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    if nan:
        model.weight.grad[0, 0] = float("nan")
    return model


# ------------------------------------------------------------------ non-finite


def test_finite_steps_pass_and_reset_the_streak():
    guard = rtrain.NonFiniteGuard(max_consecutive=2)
    assert guard.skip(torch.tensor(float("inf")))
    assert not guard.skip(torch.tensor(1.0), model=model_and_grads())
    assert guard.skip(torch.tensor(float("nan")))  # a new streak of 1, no exit
    assert (guard.consecutive, guard.skipped) == (1, 2)


def test_nan_gradients_are_a_skip_and_are_dropped():
    guard = rtrain.NonFiniteGuard()
    model = model_and_grads(nan=True)
    assert guard.skip(torch.tensor(0.5), model=model)
    assert all(p.grad is None for p in model.parameters())


def test_scaler_backs_off_and_grad_overflow_is_left_to_it():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.tensor(1.0))
    guard = rtrain.NonFiniteGuard()
    assert not guard.skip(torch.tensor(1.0), model=model_and_grads(nan=True), scaler=scaler)
    assert guard.skip(torch.tensor(float("nan")), scaler=scaler)
    assert scaler.get_scale() == 512.0


def test_consecutive_skips_end_the_attempt_as_nonfinite(status_dir):
    guard = rtrain.NonFiniteGuard(max_consecutive=3)
    guard.skip(torch.tensor(float("nan")), step=10)
    guard.skip(torch.tensor(float("nan")), step=11)
    with pytest.raises(SystemExit) as e:
        guard.skip(torch.tensor(float("nan")), step=12)
    assert e.value.code == 1
    rec = record(status_dir)
    assert rec["kind"] == "nonfinite" and rec["step"] == 12
    assert "3 consecutive steps" in rec["reason"] and rec["extra"]["skipped_steps"] == 3


# ------------------------------------------------------------------ out of memory


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
    return model, (x, y)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _loss_fn(model, fail, sizes):
    def loss_fn(mb):
        sizes.append(len(mb[0]))
        if fail(len(mb[0]), len(sizes)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return torch.nn.functional.cross_entropy(model(mb[0]), mb[1])
    return loss_fn


def test_oom_backoff_splits_with_the_same_gradients():
    model, batch = _setup()
    ref_loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    ref_loss.backward()
    ref = _grads(model)
    model.zero_grad()
    backoff = rtrain.OOMBackoff(settings={"batch_size": 16, "grad_accum": 2})
    sizes = []
    loss = backoff.run(_loss_fn(model, lambda n, _: n > 4, sizes), batch)
    assert sizes == [16, 8, 4, 4, 4, 4]
    assert torch.allclose(loss, ref_loss.detach())
    for a, b in zip(ref, _grads(model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # The smaller size sticks, and the effective batch is kept in what is reported.
    assert backoff.micro == 4
    assert degrade.effective_settings() == {"batch_size": 4, "grad_accum": 8}
    sizes.clear()
    backoff.run(_loss_fn(model, lambda n, _: n > 4, sizes), batch)
    assert sizes == [4, 4, 4, 4]


def test_oom_halfway_through_the_batch_runs_only_the_rest_smaller():
    model, batch = _setup()
    torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
    ref = _grads(model)
    model.zero_grad()
    backoff = rtrain.OOMBackoff(settings={})
    backoff.micro = 8
    sizes = []
    backoff.run(_loss_fn(model, lambda n, call: call == 2, sizes), batch)
    assert sizes == [8, 8, 4, 4]
    for a, b in zip(ref, _grads(model), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_oom_at_micro_batch_one_and_other_errors_are_raised():
    model, batch = _setup()
    sizes = []
    with pytest.raises(torch.OutOfMemoryError):
        rtrain.OOMBackoff().run(_loss_fn(model, lambda n, _: True, sizes), batch)
    assert sizes == [16, 8, 4, 2, 1]
    assert degrade.effective_settings()["batch_size"] == 1

    def bad(mb):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        rtrain.OOMBackoff().run(bad, batch)


def test_dict_batches_and_a_custom_backward():
    model, (x, y) = _setup()
    seen = []
    loss = rtrain.OOMBackoff().run(
        lambda mb: torch.nn.functional.cross_entropy(model(mb["x"]), mb["y"]),
        {"x": x, "y": y, "name": "b0"}, backward=lambda t: seen.append(t) or t.backward())
    assert len(seen) == 1 and torch.isfinite(loss)


# ------------------------------------------------------------------ bad samples


class Flaky(torch.utils.data.Dataset):
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 40

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"cannot decode image {i}")
        return torch.tensor([float(i)])


def test_bad_samples_are_dropped_and_counted():
    ds = rtrain.SkipBadSamples(Flaky({3, 17}), max_rate=0.2, min_samples=10)
    loader = DataLoader(ds, batch_size=8, collate_fn=rtrain.skip_none_collate)
    got = torch.cat(list(loader)).flatten().tolist()
    assert len(got) == 38 and 3 not in got and 17 not in got
    assert (ds.bad, ds.fetched) == (2, 40)
    assert rtrain.skip_none_collate([None, None]) is None


def test_too_many_bad_samples_end_the_attempt_as_data(status_dir):
    ds = rtrain.SkipBadSamples(Flaky(set(range(0, 40, 3))), max_rate=0.1, min_samples=10)
    with pytest.raises(rtrain.DataError, match="samples failed to load") as e:
        list(DataLoader(ds, batch_size=4, collate_fn=rtrain.skip_none_collate))
    rec = record(status_dir)
    assert rec["kind"] == "data" and "cannot decode image" in rec["reason"]
    # The excepthook does not overwrite it with "crash".
    calls = []
    sys_hook = sys.excepthook
    try:
        sys.excepthook = lambda *a: calls.append(a)
        degrade.install_excepthook()
        sys.excepthook(type(e.value), e.value, None)
    finally:
        sys.excepthook = sys_hook
    assert record(status_dir)["kind"] == "data" and len(calls) == 1


# ------------------------------------------------------------------ uncaught exceptions


@pytest.mark.parametrize("exc, kind", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom_gpu"),
    (RuntimeError("CUDA error: out of memory"), "oom_gpu"),
    (MemoryError(), "oom_host"),
    (ValueError("bad shape"), "crash"),
])
def test_excepthook_writes_the_kind_then_chains(status_dir, monkeypatch, exc, kind):
    calls = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: calls.append(a))
    rtrain.install_excepthook()
    rtrain.install_excepthook()  # twice is once
    degrade._overrides["batch_size"] = 4
    sys.excepthook(type(exc), exc, None)
    rec = record(status_dir)
    assert rec["kind"] == kind and rec["settings"] == {"batch_size": 4}
    assert len(calls) == 1 and calls[0][1] is exc
