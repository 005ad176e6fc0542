"""The examples load data with worker processes and stay exact: a run that crashes mid-epoch and
resumes ends bitwise-identical to one that did not (augmentation from rtrain.sample_generator)."""

import json
import subprocess
import sys

import pytest
from bitwise import bitwise_diff
from harness import REPO, child_env
from safetensors.torch import load_file


def run(script, ckpt, knobs, faults=None):
    env = child_env(RTRAIN_ATTEMPT="0", RTRAIN_CKPT_DIR=str(ckpt),
                    RTRAIN_SETTINGS=json.dumps(knobs))
    if faults:
        env["RTRAIN_FAULTS"] = faults
    return subprocess.run([sys.executable, str(REPO / "examples" / script)], cwd=ckpt.parent,
                          env=env, capture_output=True, text=True, timeout=150)


def final_state(ckpt, step):
    d = ckpt / f"checkpoint-{step}"
    return {stem: load_file(d / f"{stem}.safetensors") for stem in ("model", "optimizer")}


@pytest.mark.slow
@pytest.mark.parametrize(("script", "knobs"), [
    # Soak too: loader workers resumed mid-epoch exactly are test_data_workers' in the default
    # tier, and the vision example's recovery test_examples'.
    pytest.param("vision/train.py", {"steps": 12, "save_every": 3, "samples": 72,
                                     "batch_size": 8, "resolution": 16, "workers": 2},
                 marks=pytest.mark.soak),
    pytest.param("charlm/train.py", {"steps": 10, "save_every": 3, "seq_len": 16,
                                     "batch_size": 8, "workers": 2}, marks=pytest.mark.soak),
])
def test_example_with_workers_resumes_mid_epoch_exactly(tmp_path, script, knobs):
    whole = tmp_path / "whole" / "ckpt"
    whole.parent.mkdir()
    r = run(script, whole, knobs)
    assert r.returncode == 0, r.stderr[-3000:]
    split = tmp_path / "split" / "ckpt"
    split.parent.mkdir()
    r = run(script, split, knobs, faults="crash@step=8")  # resumes from step 6, mid-epoch
    assert r.returncode == 1 and "injected crash at step 8" in r.stderr, r.stderr[-3000:]
    r = run(script, split, knobs)
    assert r.returncode == 0 and "resumed at step 6" in r.stdout, r.stderr[-3000:]
    steps = knobs["steps"]
    assert bitwise_diff(final_state(whole, steps), final_state(split, steps)) is None
