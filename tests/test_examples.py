"""The examples train, checkpoint and resume, run by hand (no supervisor) for a few steps."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from harness import REPO, checkpoint_steps, child_env

EXAMPLES = REPO / "examples"


def run(script, *args, cwd, settings=None, faults=None, attempt=0):
    env = child_env(RTRAIN_ATTEMPT=str(attempt), RTRAIN_CKPT_DIR=str(cwd / "ckpt"))
    if settings:
        env["RTRAIN_SETTINGS"] = json.dumps(settings)
    if faults:
        env["RTRAIN_FAULTS"] = faults
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def losses(out):
    return [float(x) for x in re.findall(r"^step \d+\S* loss (\S+)", out, re.MULTILINE)]



@pytest.mark.slow
def test_vision_backs_off_crashes_and_resumes(tmp_path):
    knobs = {"steps": 8, "save_every": 3, "log_every": 1, "samples": 256, "batch_size": 8,
             "resolution": 16}
    # Attempt 0: the in-process back-off halves the batch, then an injected crash at step 7.
    r = run("vision/train.py", cwd=tmp_path, settings=knobs,
            faults="oom_step@batch_size>4; crash@step=7")
    assert r.returncode == 1, r.stderr
    assert "injected crash at step 7" in r.stderr
    assert "step 1 loss" in r.stdout and "batch 4x2" in r.stdout
    assert checkpoint_steps(tmp_path / "ckpt") == [3, 6]
    # Attempt 1 is not armed: it resumes after the newest checkpoint and finishes.
    r = run("vision/train.py", cwd=tmp_path, settings=knobs, faults="crash@step=7", attempt=1)
    assert r.returncode == 0, r.stderr
    assert "resumed at step 6" in r.stdout and "step 7 loss" in r.stdout
    assert "done: 8 steps" in r.stdout and "batch 8x1" in r.stdout
    assert all(math.isfinite(x) for x in losses(r.stdout))
    assert checkpoint_steps(tmp_path / "ckpt") == [3, 6, 8]


@pytest.mark.slow
@pytest.mark.soak  # an example resumed after a crash: the vision example's default-tier test
def test_charlm_trains_with_autocast_and_resumes(tmp_path):
    knobs = {"steps": 4, "save_every": 2, "log_every": 1, "seq_len": 16, "batch_size": 8,
             "amp": True}  # bfloat16 autocast on the CPU
    r = run("charlm/train.py", cwd=tmp_path, settings=knobs)
    assert r.returncode == 0, r.stderr
    first = losses(r.stdout)
    assert len(first) == 4 and all(math.isfinite(x) for x in first)
    assert checkpoint_steps(tmp_path / "ckpt") == [2, 4]
    state = json.loads((tmp_path / "ckpt" / "checkpoint-4" / "state.json").read_text())
    assert "scaler" in state and state["sampler"]["samples_seen"] == 32
    r = run("charlm/train.py", cwd=tmp_path, settings={**knobs, "steps": 6})
    assert r.returncode == 0, r.stderr
    assert "resumed at step 4" in r.stdout and "done: 6 steps" in r.stdout
    assert len(losses(r.stdout)) == 2


@pytest.mark.slow
@pytest.mark.soak  # README.md:92 runs this example as written, in the default tier
def test_plain_script_resumes_from_its_own_file(tmp_path):
    args = ["--steps", "5", "--save-every", "2", "--ckpt", str(tmp_path / "plain.pt")]
    r = run("plain/train.py", *args, "--crash-at", "4", cwd=tmp_path)
    assert r.returncode == 1 and "fake crash at step 4" in r.stderr
    assert torch.load(tmp_path / "plain.pt", weights_only=True)["step"] == 2
    r = run("plain/train.py", *args, "--crash-at", "4", cwd=tmp_path)  # the crash was once
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step 3/5" in r.stdout and "step 2/5" not in r.stdout
    assert len(losses(r.stdout)) == 3 and all(math.isfinite(x) for x in losses(r.stdout))
    assert torch.load(tmp_path / "plain.pt", weights_only=True)["step"] == 5
