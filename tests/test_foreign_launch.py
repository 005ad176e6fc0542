"""`rtrain launch` over scripts that keep their own checkpoints: `--resume-arg`, and real Hugging
Face Trainer and Lightning runs, killed once and out of memory once, resumed from the right
checkpoint with degraded settings until they finish. Asserts on events.jsonl and on the
checkpoints the frameworks wrote."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
import torch
from harness import CHILDREN, events, run_rtrain
from harness import launch as launch_run
from test_foreign_verify import flip, member_data_offset

# Offline: the scripts build their models from configs and must never reach for the hub.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def launch_in(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`rtrain launch --run-dir TMP/run ARGS`, run in TMP."""
    return launch_run(tmp / "run", *args, env=OFFLINE, timeout=timeout)


def name_of(path: str | None) -> str | None:
    return None if path is None else Path(path).name


ECHO = """import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "from": os.environ.get("RTRAIN_RESUME_FROM")}))
"""


@pytest.mark.slow
def test_resume_arg_only_when_a_checkpoint_was_chosen(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO)
    ckpts = tmp_path / "ck pts"  # a space: the path must stay one argument
    ckpts.mkdir()
    args = ["--ckpt-dir", str(ckpts), "--resume-arg", "--resume_from_checkpoint {checkpoint}",
            "--resume-arg", "--note 'from a checkpoint'", "echo.py", "--", "--ck", "{checkpoint}"]
    r = launch_in(tmp_path, *args)
    assert r.returncode == 0, r.stderr
    (launch,) = events(tmp_path / "run", "launch")
    assert launch["resume_from"] is None and launch["argv"][-2:] == ["--ck", ""]

    torch.save({"step": 4}, ckpts / "step_4.pt")
    torch.save({"step": 8}, ckpts / "step_8.pt")
    # The newest is damaged (a byte of its pickle flipped): resume falls back to step_4.pt.
    flip(ckpts / "step_8.pt", member_data_offset(ckpts / "step_8.pt", "data.pkl") + 2)
    r = launch_in(tmp_path, "--fresh", *args)
    assert r.returncode == 0, r.stderr
    launch = events(tmp_path / "run", "launch")[-1]
    chosen = str((ckpts / "step_4.pt").resolve())
    assert launch["resume_from"] == chosen
    assert launch["argv"][-6:] == ["--ck", chosen, "--resume_from_checkpoint", chosen,
                                   "--note", "from a checkpoint"]
    (skip,) = [e for e in events(tmp_path / "run", "skipped_checkpoint")
               if name_of(e["path"]) == "step_8.pt"]
    assert "data.pkl'" in skip["reason"] and "CRC-32" in skip["reason"]
    out = json.loads((tmp_path / "run" / "attempts" / "0" / "stdout.log").read_text())
    assert out["from"] == chosen


@pytest.mark.slow
def test_resume_arg_typo_is_a_usage_error(tmp_path):
    (tmp_path / "echo.py").write_text(ECHO)
    r = launch_in(tmp_path, "--resume-arg", "--from {chekpoint}", "echo.py")
    assert r.returncode == 2 and "chekpoint" in r.stderr


def run_with_kill_and_oom(tmp_path: Path, script: str, knob_args: list[str],
                          resume_arg: str) -> Path:
    """Kill at step 6 (checkpoint-4 exists), OOM from step 10 while batch > 2 (checkpoint-8
    exists): attempts resume from 4 then 8, the last with batch 2 x accumulation 2."""
    out = tmp_path / "out"
    r = launch_in(tmp_path, "--ckpt-dir", str(out), "--set", "batch_size=4", "--set",
               "grad_accum=1", "--resume-arg", resume_arg, str(CHILDREN / script), "--",
               *knob_args, "--kill_at", "6", "--oom_above", "2", "--oom_from", "10",
               timeout=150)
    run = tmp_path / "run"
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["failure"] for e in events(run, "classification")] == ["crash", "oom_gpu"]
    launches = events(run, "launch")
    assert [(e["settings"]["batch_size"], e["settings"]["grad_accum"]) for e in launches] == \
        [(4, 1), (4, 1), (2, 2)]
    flag = resume_arg.split()[0]
    assert flag not in launches[0]["argv"]
    for e in launches[1:]:
        assert e["argv"][-2:] == [flag, e["resume_from"]]
    logs = [(run / "attempts" / str(i) / "stdout.log").read_text() for i in range(3)]
    assert "killing myself at step 6" in logs[0]
    assert "first step 5 batch 4 accum 1" in logs[1]  # resumed after step 4
    assert "first step 9 batch 2 accum 2" in logs[2]  # resumed after step 8, degraded
    assert "done at global_step 16" in logs[2]
    assert events(run, "finished")
    return out


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None
                    or importlib.util.find_spec("accelerate") is None,
                    reason="transformers/accelerate not installed (pip install -e '.[dev]')")
def test_hugging_face_trainer_killed_and_oom_resumes_and_finishes(tmp_path):
    out = run_with_kill_and_oom(
        tmp_path, "hf_train.py",
        ["--output_dir", "{ckpt_dir}", "--per_device_train_batch_size", "{batch_size}",
         "--gradient_accumulation_steps", "{grad_accum}"],
        "--resume_from_checkpoint {checkpoint}")
    launches = events(tmp_path / "run", "launch")
    assert [name_of(e["resume_from"]) for e in launches] == [None, "checkpoint-4",
                                                             "checkpoint-8"]
    state = json.loads((out / "checkpoint-16" / "trainer_state.json").read_text())
    assert state["global_step"] == 16
    # global_step continued across attempts: every step logged once, in order.
    assert [e["step"] for e in state["log_history"] if "loss" in e] == list(range(1, 17))
    r = run_rtrain("inspect", str(out), "--verify", "full", env=OFFLINE)
    assert r.returncode == 0, r.stderr
    assert "resume would pick checkpoint-16" in r.stdout and "ok (hf-trainer)" in r.stdout


def _lightning_missing() -> bool:
    return (importlib.util.find_spec("lightning") is None
            and importlib.util.find_spec("pytorch_lightning") is None)


@pytest.mark.slow
@pytest.mark.soak  # a foreign format; the Trainer run is the default tier's
@pytest.mark.skipif(_lightning_missing(),
                    reason="lightning / pytorch-lightning not installed (pip install -e '.[dev]')")
def test_lightning_killed_and_oom_resumes_and_finishes(tmp_path):
    out = run_with_kill_and_oom(
        tmp_path, "lightning_train.py",
        ["--ckpt_dir", "{ckpt_dir}", "--batch_size", "{batch_size}",
         "--accumulate_grad_batches", "{grad_accum}"],
        "--ckpt_path {checkpoint}")
    launches = events(tmp_path / "run", "launch")
    assert [name_of(e["resume_from"]) for e in launches] == [
        None, "epoch=0-step=4.ckpt", "epoch=0-step=8.ckpt"]
    assert (out / "epoch=0-step=16.ckpt").is_file()
