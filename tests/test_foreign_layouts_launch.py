"""Scripts that keep their checkpoints in a popular trainer's layout (children/layouts_train.py:
imagenet's checkpoint.pth.tar, timm's CheckpointSaver, DeepSpeed, Composer, torchtitan's DCP,
and accelerate's save_state with the real library), run unchanged under `rtrain launch
--ckpt-dir out --resume-arg "--resume {checkpoint}"`, SIGKILLed right after three saves: each
relaunch is handed the newest save (the file, or the save's directory) and the run finishes on
the default settings. And the bad input of each kind refused in one line, never run, the save
before it handed to the script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from harness import CHILDREN, events
from harness import launch as launch_run

SCRIPT = str(CHILDREN / "layouts_train.py")

# layout -> the name of what each relaunch resumes from, after saves 1, 2 and 3.
PICKS = {
    "imagenet": ["checkpoint.pth.tar"] * 3,  # never model_best.pth.tar (a copy of save 1)
    "timm": ["checkpoint-1.pth.tar", "checkpoint-2.pth.tar", "checkpoint-3.pth.tar"],
    "deepspeed": ["global_step1", "global_step2", "global_step3"],
    "composer": ["ep1-ba3-rank0.pt", "ep2-ba6-rank0.pt", "ep3-ba9-rank0.pt"],
    "dcp": ["step-1", "step-2", "step-3"],
    "accelerate": ["step_1", "step_2", "step_3"],
}


# Written by a small script in the library's style: the recognition of these is the unit tests'
# (test_foreign_layouts.py); their runs but imagenet's are the soak tier's, to keep the default
# tier short.
_SOAK = {"deepspeed", "composer", "dcp", "timm", "accelerate"}  # imagenet: the default tier's


@pytest.mark.slow
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.soak) if k in _SOAK else k
                                    for k in PICKS])
def test_killed_after_three_saves_resumes_from_the_newest_each_time(tmp_path, layout):
    if layout == "accelerate" and importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate not installed (pip install -e '.[dev]')")
    out = tmp_path / "out"
    r = launch_run(tmp_path / "run", "--ckpt-dir", str(out), "--resume-arg",
                   "--resume {checkpoint}", SCRIPT, "--", "--layout", layout, "--out_dir",
                   str(out), "--kill_after", "1,2,3", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "done.json").is_file()
    starts = [int(s) for s in (out / "starts.txt").read_text().split()]
    assert starts == [1, 2, 3, 4]  # each relaunch from the save just before the kill
    launches = events(tmp_path / "run", "launch")
    assert launches[0]["resume_from"] is None
    assert [Path(e["resume_from"]).name for e in launches[1:]] == PICKS[layout]
    for e in launches[1:]:
        assert e["argv"][-2:] == ["--resume", e["resume_from"]]  # the file, or the save's dir
    assert not events(tmp_path / "run", "give_up")
    assert not events(tmp_path / "run", "skipped_checkpoint")


ECHO = "import sys; print(sys.argv[1:])\n"


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["evil pth.tar", "step dir missing a file", "latest outside"])
def test_bad_input_refused_in_one_line_never_run_the_save_before_handed_over(tmp_path, bad):
    from test_foreign_layouts import accelerate_save, evil_zip, write

    out, marker = tmp_path / "out", tmp_path / "pwned"
    if bad == "evil pth.tar":
        write("timm", out, saves=2)
        evil_zip(out / "checkpoint-3.pth.tar", marker)
        refused, before, why = "checkpoint-3.pth.tar", "checkpoint-2.pth.tar", "posix.system"
    elif bad == "step dir missing a file":
        if importlib.util.find_spec("accelerate") is None:
            pytest.skip("accelerate not installed (pip install -e '.[dev]')")
        accelerate_save(out, 1)
        (accelerate_save(out, 2) / "optimizer.bin").unlink()
        refused, before, why = "step_2", "step_1", "file 'optimizer.bin' is missing"
    else:
        write("deepspeed", out, saves=2)
        (out / "latest").write_text("../../etc")
        refused, before, why = "latest", "global_step2", "names '../../etc'"
    (tmp_path / "echo.py").write_text(ECHO)
    r = launch_run(tmp_path / "run", "--ckpt-dir", str(out), "--resume-arg",
                   "--resume {checkpoint}", "echo.py")
    assert r.returncode == 0, r.stderr
    (launch,) = events(tmp_path / "run", "launch")
    assert Path(launch["resume_from"]).name == before
    assert launch["argv"][-2:] == ["--resume", launch["resume_from"]]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith(f"rtrain: skipping {refused}")]
    assert why in line
    (skip,) = events(tmp_path / "run", "skipped_checkpoint")
    assert Path(skip["path"]).name == refused and why in skip["reason"]
    assert not marker.exists()
