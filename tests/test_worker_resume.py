"""A run split into processes (save, die, new process, restore) ends bitwise-identical."""

import subprocess
import sys

import pytest
import torch
from bitwise import assert_bitwise_equal
from harness import CHILDREN, child_env
from references import bitwise_run

SCRIPT = CHILDREN / "train_bitwise.py"


def run(ckpt_dir, out, total, die_at, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), str(ckpt_dir), str(out), str(total),
                           str(die_at), *extra], env=child_env(), capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def uninterrupted():
    """The final state of the run never killed. Saving in the background or not changes no
    value a step trains on, so both modes below are compared with this one run."""
    return torch.load(bitwise_run(31))


@pytest.mark.slow
# The default tier resumes the background writer (the harder case); a plain save in the soak tier.
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.soak), "async"])
def test_split_run_is_bitwise_identical(tmp_path, mode, uninterrupted):
    extra = ["--async"] if mode == "async" else []
    ckpts = tmp_path / "split"
    # Deaths mid-epoch, right after a save, at an epoch boundary (44 samples / 8 = 6 steps),
    # and twice in a row before any new save: each resume replays from the newest checkpoint.
    for die_at in (4, 9, 12, 13, 13):
        r = run(ckpts, tmp_path / "split.pt", 31, die_at, *extra)
        assert r.returncode == 9, r.stderr
    r = run(ckpts, tmp_path / "split.pt", 31, 0, *extra)
    assert r.returncode == 0, r.stderr
    a = uninterrupted
    b = torch.load(tmp_path / "split.pt")
    assert a["step"] == b["step"] == 31
    assert_bitwise_equal(a["model"], b["model"], "model")
    assert_bitwise_equal(a["opt"], b["opt"], "optimizer")
