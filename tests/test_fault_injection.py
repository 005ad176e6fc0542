"""rtrain.worker.guards.faults: RTRAIN_FAULTS parsing, each fault in the right attempt only, free
when off."""

import importlib
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import CHILDREN, child_env

import rtrain
from rtrain.checkpoint.layout import list_checkpoints, list_leftovers
from rtrain.checkpoint.verify import select_rtrain_resume, verify
from rtrain.worker.guards import degrade, faults

CHILD = CHILDREN / "checkpointer_every_step.py"


def faults_env(spec: str, attempt: int = 0) -> dict[str, str]:
    return child_env(RTRAIN_FAULTS=spec, RTRAIN_ATTEMPT=str(attempt))


@pytest.fixture
def arm(monkeypatch):
    """Re-import rtrain.worker.guards.faults under an RTRAIN_FAULTS spec; put the unarmed module
    back after."""

    def _arm(spec, attempt=0, settings=None):
        monkeypatch.setenv("RTRAIN_FAULTS", spec)
        monkeypatch.setenv("RTRAIN_ATTEMPT", str(attempt))
        if settings is not None:
            monkeypatch.setenv("RTRAIN_SETTINGS", json.dumps(settings))
        return importlib.reload(faults)

    yield _arm
    monkeypatch.delenv("RTRAIN_FAULTS", raising=False)
    monkeypatch.delenv("RTRAIN_ATTEMPT", raising=False)
    monkeypatch.delenv("RTRAIN_SETTINGS", raising=False)
    importlib.reload(faults)
    degrade._overrides.clear()


def test_off_every_hook_is_the_noop(monkeypatch):
    monkeypatch.delenv("RTRAIN_FAULTS", raising=False)
    f = importlib.reload(faults)
    assert f.step_hook is f.noop and f.on_save_write is f.noop and f.in_step is f.noop
    assert f.poison_loss is f.identity


def test_armed_for_another_attempt_is_off(arm):
    f = arm("crash@step=3,attempt=1; hang@step=1,attempt=2|3", attempt=0)
    assert f.step_hook is f.noop
    f = arm("crash@step=3,attempt=1", attempt=1)
    assert f.step_hook is not f.noop


def test_crash_fires_at_its_step_in_attempt_zero_by_default(arm):
    f = arm("crash@step=3")
    f.step_hook(2)
    with pytest.raises(RuntimeError, match="injected crash at step 3"):
        f.step_hook(3)
    assert arm("crash@step=3", attempt=1).step_hook is faults.noop  # the relaunch recovers


def test_any_attempt(arm):
    for attempt in (0, 4):
        with pytest.raises(RuntimeError):
            arm("crash@step=0,attempt=*", attempt=attempt).step_hook(1)


def test_crash_through_the_checkpointer(arm, tmp_path):
    f = arm("crash@step=2")
    ck = rtrain.Checkpointer(model=torch.nn.Linear(2, 2), ckpt_dir=tmp_path, every=1)
    ck.maybe_save(1)
    with pytest.raises(RuntimeError, match="step 2"):
        ck.maybe_save(2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]  # before the step's save
    assert f.step_hook is not f.noop


def test_oom_while_knob_above_value(arm):
    f = arm("oom@batch_size>16,attempt=*", settings={"batch_size": 32})
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as e:
        f.step_hook(1)
    assert degrade.exit_kind(e.value) == "oom_gpu"
    arm("oom@batch_size>16,attempt=*", settings={"batch_size": 16}).step_hook(1)
    # A size the in-process back-off settled on counts too.
    f = arm("oom@batch_size>16,attempt=*", settings={"batch_size": 32})
    degrade._overrides["batch_size"] = 8
    f.step_hook(1)


def test_oom_step_inside_the_forward(arm):
    f = arm("oom_step@batch_size>8")
    f.in_step(batch_size=8)
    with pytest.raises(torch.OutOfMemoryError):
        f.in_step(batch_size=9)


@pytest.mark.parametrize("kind, error", [("crash_forward", RuntimeError),
                                         ("oom_forward", torch.OutOfMemoryError)])
def test_forward_faults_raise_from_in_step_at_their_step(arm, kind, error):
    f = arm(f"{kind}@step=3")
    assert f.step_hook is f.noop  # not from maybe_save: before the optimizer step
    f.in_step(step=2, batch_size=8)
    f.in_step(batch_size=8)  # a script that does not say the step is never hit
    with pytest.raises(error, match="forward of step 3"):
        f.in_step(step=3, batch_size=8)
    f = arm(f"{kind}@step=3")  # a process resumed past step 3: its first step completes
    f.in_step(step=7, batch_size=8)
    f.in_step(step=7, batch_size=8)  # the step's second micro-batch
    with pytest.raises(error, match="forward of step 8"):
        f.in_step(step=8, batch_size=8)


def test_nonfinite_for_count_steps(arm):
    f = arm("nonfinite@step=4,count=2")
    loss = torch.tensor(1.0, requires_grad=True)
    finite = [bool(torch.isfinite(f.poison_loss(loss * 2, s))) for s in range(3, 8)]
    assert finite == [True, False, False, True, True]
    f.poison_loss(loss * 2, 4).backward()
    assert torch.isnan(loss.grad)


def test_corrupt_newest_then_crash(arm, tmp_path):
    arm("corrupt_newest@step=2")
    ck = rtrain.Checkpointer(model=torch.nn.Linear(2, 2), ckpt_dir=tmp_path, every=1)
    ck.maybe_save(1)
    ck.maybe_save(2)  # committed inside this call, after the hook ran
    with pytest.raises(RuntimeError, match="corrupting checkpoint-2"):
        ck.maybe_save(3)
    assert not verify(tmp_path / "checkpoint-2", "full").ok
    assert select_rtrain_resume(tmp_path, "full").chosen.step == 1


@pytest.mark.parametrize("spec, message", [
    ("explode@step=1", "unknown fault kind 'explode'"),
    ("crash@step=x", "step must be an integer"),
    ("crash@step=-1", "must not be negative"),
    ("crash@when=3", "cannot read condition 'when=3'"),
    ("crash@batch_size>3", "knob condition applies to oom"),
    ("crash@count=2", "count= applies to nonfinite only"),
    ("nonfinite@count=0", "count must be at least 1"),
    ("oom_step@step=2", "needs a size condition"),
    ("crash@attempt=a|1", "attempt must be an integer"),
])
def test_parse_errors_are_one_line(spec, message):
    with pytest.raises(faults.FaultSpecError) as e:
        faults.parse(f"hang@step=9; {spec}")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("RTRAIN_FAULTS: ")


def test_parse_full_syntax():
    fs = faults.parse(" crash@step=30,attempt=0; oom@batch_size>16 ;hang@step=50;"
                      "nonfinite@step=40,count=5; kill_in_save@step=20; corrupt_newest@step=25;"
                      "crash")
    assert [f.kind for f in fs] == ["crash", "oom", "hang", "nonfinite", "kill_in_save",
                                    "corrupt_newest", "crash"]
    assert fs[1].knob == "batch_size" and fs[1].above == 16 and fs[1].attempts == {0}
    assert fs[3].count == 5 and fs[6].step == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "fork"])
def test_kill_in_save_kills_the_training_process_mid_write(tmp_path, mode):
    r = subprocess.run([sys.executable, str(CHILD), str(tmp_path), "5", mode],
                       env=faults_env("kill_in_save@step=2"), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert [t.step for t in list_leftovers(tmp_path)] == [2]  # half written, never listed
    if mode == "sync":
        assert "step 3" not in r.stdout  # async: training may go on while the writer works
    if mode == "fork":
        return
    # The relaunch (attempt 1) is not armed and finishes.
    r = subprocess.run([sys.executable, str(CHILD), str(tmp_path), "5", mode],
                       env=faults_env("kill_in_save@step=2", attempt=1), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["step", "2"]


@pytest.mark.slow
def test_hang_stops_the_loop_and_heartbeats(tmp_path):
    proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path), "5"],
                            env=faults_env("hang@step=2"), stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        assert lines == ["step 1", "step 2", "rtrain faults: injected hang at step 2"]
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
