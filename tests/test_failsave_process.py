"""Save at the failure in real processes: an uncaught exception in the forward commits the last
completed step and a relaunch loses none, bitwise; inside optimizer.step or on SIGKILL nothing
is committed. Under `rtrain launch` the supervisor records a `checkpoint_at_failure` event."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from chaos_util import (
    SCRIPT,
    final_state_diff,
    launch_chaos,
    reference,
    replayed_steps,
    starts,
    step_log,
    write_config,
)
from harness import CHILDREN, child_env, events

from rtrain.checkpoint.layout import list_checkpoints

SETTINGS = {"steps": 30, "save_every": 8, "keep": 10}  # keep: the failure's checkpoint stays


def _info(ckpt_dir, step):
    return json.loads((ckpt_dir / f"checkpoint-{step}" / "manifest.json").read_text())["info"]


@pytest.mark.slow
def test_a_crash_in_the_forward_under_rtrain_loses_no_step(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    write_config(tmp_path / "rtrain.toml", SETTINGS)
    run = tmp_path / "run"
    r = launch_chaos(run, faults="crash_forward@step=13")
    assert r.returncode == 0, r.stderr[-3000:]

    saved = events(run, "checkpoint_at_failure")
    assert [(e["attempt"], e["step"], e["exception"]) for e in saved] == [(0, 12, "RuntimeError")]
    assert [c["failure"] for c in events(run, "classification")] == ["crash"]
    assert events(run, "launch")[1]["resume_from"].endswith("/checkpoint-12")
    ckpts = run / "checkpoints"
    assert _info(ckpts, 12)["saved_at_failure"] is True
    log = step_log(run)
    assert [s["start"] for s in starts(log)] == [0, 12]
    assert replayed_steps(log) == 0  # steps 1..12 ran once; 13 failed before its step record
    assert final_state_diff(run, ref) is None


@pytest.mark.slow
@pytest.mark.soak  # the crash under rtrain is the default tier's
def test_a_cuda_oom_in_the_forward_without_rtrain_resumes_bitwise(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    out = tmp_path / "out"
    env = {"RTRAIN_SETTINGS": json.dumps(SETTINGS), "RTRAIN_CKPT_DIR": str(out / "checkpoints"),
           "RTRAIN_FAULTS": "oom_forward@step=21"}
    first = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=child_env(**env),
                           capture_output=True, text=True, timeout=150)
    assert first.returncode == 1 and "OutOfMemoryError" in first.stderr, first.stderr[-3000:]
    assert "checkpoint of step 20 committed at the failure" in first.stderr
    assert [s for s, _ in list_checkpoints(out / "checkpoints")][:2] == [20, 16]
    assert _info(out / "checkpoints", 20)["failure"] == "OutOfMemoryError"
    again = subprocess.run([sys.executable, str(SCRIPT), str(out)],
                           env=child_env(**env, RTRAIN_ATTEMPT="1"), capture_output=True,
                           text=True, timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    assert replayed_steps(step_log(out)) == 0
    assert final_state_diff(out, ref) is None


def _fail(tmp_path, mode):
    ckpts = tmp_path / "ck"
    r = subprocess.run([sys.executable, str(CHILDREN / "fail_in_step.py"), str(ckpts), mode, "5"],
                       env=child_env(), capture_output=True, text=True, timeout=120)
    return r, [s for s, _ in list_checkpoints(ckpts)]


@pytest.mark.slow
def test_an_exception_inside_optimizer_step_commits_nothing(tmp_path):
    r, saved = _fail(tmp_path, "optimizer")
    assert r.returncode == 1 and "half-way through the optimizer step" in r.stderr, r.stderr
    assert "no checkpoint at the failure: an optimizer step had started since step 4" in r.stderr
    assert saved == []


@pytest.mark.slow
def test_sigkill_commits_nothing(tmp_path):
    r, saved = _fail(tmp_path, "sigkill")
    assert r.returncode == -9
    assert saved == []


@pytest.mark.slow
@pytest.mark.parametrize("mode, code", [
    # an uncaught exception in the forward committing the step before: the default tier's
    # test_a_crash_in_the_forward_under_rtrain_loses_no_step, under rtrain, bitwise
    pytest.param("forward", 1, marks=pytest.mark.soak),
    ("caught", 3)])
def test_an_exception_in_the_forward_commits_the_step_before(tmp_path, mode, code):
    r, saved = _fail(tmp_path, mode)
    assert r.returncode == code, r.stderr
    assert saved == [4]
    assert _info(tmp_path / "ck", 4)["saved_at_failure"] is True
