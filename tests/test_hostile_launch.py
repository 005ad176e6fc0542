"""`rtrain launch --resume auto` over a checkpoint that verifies fully but cannot be loaded (or
must not be): the worker says so (`bad_checkpoint`), rtrain skips that checkpoint, resumes from
the one before and the run finishes. Real supervisor, real torch children.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from harness import CHILDREN, events, launch, run_rtrain
from hostile import claim_huge_header, code_running_pickle, manifest, relist

import rtrain
from rtrain.supervisor.records.runstate import load_state

CHILD = CHILDREN / "checkpointer_resume.py"
pytestmark = pytest.mark.slow


def good_checkpoints(ckpt_dir: Path) -> None:
    """checkpoint-2 and checkpoint-4 of the child's own model (children/checkpointer_resume.py)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, keep=None)
    for step in (2, 4):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        ck.save(step)


def launch_child(run_dir: Path, *child_args: str) -> subprocess.CompletedProcess:
    """`rtrain launch --resume auto` of the child for 8 steps (its resumes go to resumed.jsonl)."""
    return launch(run_dir, "--resume", "auto", str(CHILD), "8", str(run_dir / "resumed.jsonl"),
                  *child_args, timeout=150)


def assert_resumed_from_the_previous_one(run_dir: Path, r: subprocess.CompletedProcess,
                                         reason: str) -> None:
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    launches = events(run_dir, "launch")
    assert [Path(e["resume_from"]).name for e in launches] == ["checkpoint-4", "checkpoint-2"]
    (cls,) = events(run_dir, "classification")
    assert cls["failure"] == "bad_checkpoint" and reason in cls["reason"], cls
    # Recorded when the worker failed; a swapped file also fails the next full verification.
    skips = events(run_dir, "skipped_checkpoint")
    assert {e["path"] for e in skips} == {str(ckpts / "checkpoint-4")}
    assert skips[0]["reason"] == f"cannot load: {cls['reason']}"
    assert events(run_dir, "finished")
    resumed = [json.loads(line) for line in (run_dir / "resumed.jsonl").read_text().splitlines()]
    assert resumed == [{"resumed": 2, "attempt": "1"}]
    bad = load_state(run_dir).history.bad_checkpoints
    assert len(bad) == 1 and bad[0].startswith(str(ckpts / "checkpoint-4") + "|")


# Soak: the worker refusing this checkpoint and restoring the one before is
# test_hostile_restore.py's, in-process; what a launch does with a worker's bad_checkpoint is
# the same for every reason, and the two tests below keep it in the default tier.
@pytest.mark.soak
def test_header_claiming_8_gib_resumes_from_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    good_checkpoints(run_dir / "checkpoints")
    claim_huge_header(run_dir / "checkpoints" / "checkpoint-4")
    inspect = run_rtrain("inspect", str(run_dir / "checkpoints"), "--verify", "full")
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    r = launch_child(run_dir)
    assert_resumed_from_the_previous_one(run_dir, r, "header length 8589934592 does not fit")


def test_pickle_in_a_checkpoint_never_runs_under_launch(tmp_path):
    run_dir = tmp_path / "run"
    good_checkpoints(run_dir / "checkpoints")
    bad = run_dir / "checkpoints" / "checkpoint-4"
    marker = tmp_path / "PWNED"
    relist(bad, "dcp/.metadata", code_running_pickle(marker),
           info={**manifest(bad)["info"], "layout": "sharded"})
    inspect = run_rtrain("inspect", str(run_dir / "checkpoints"), "--verify", "full")
    assert inspect.returncode == 0 and "checkpoint-4" in inspect.stdout, inspect.stdout
    r = launch_child(run_dir)
    assert not marker.exists(), "a pickle from the checkpoint ran under rtrain launch"
    assert_resumed_from_the_previous_one(run_dir, r, "no process group")


def test_file_swapped_after_verification_is_caught_by_the_worker(tmp_path):
    """Between rtrain's full verification and the worker's load, model.safetensors is replaced
    by another of the same size (the child does it at attempt 0, just before restore())."""
    run_dir = tmp_path / "run"
    good_checkpoints(run_dir / "checkpoints")
    ckpts = run_dir / "checkpoints"
    src = ckpts / "checkpoint-2" / "model.safetensors"
    dst = ckpts / "checkpoint-4" / "model.safetensors"
    assert src.stat().st_size == dst.stat().st_size
    r = launch_child(run_dir, "--swap", str(src), str(dst))
    assert_resumed_from_the_previous_one(run_dir, r, "content hash does not match")


@pytest.mark.soak  # as the 8 GiB header: test_hostile_restore.py's state.json cases, in-process
def test_state_json_symlinked_and_unlisted_gives_a_reason_not_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    good_checkpoints(run_dir / "checkpoints")
    bad = run_dir / "checkpoints" / "checkpoint-4"
    m = manifest(bad)
    del m["files"]["state.json"]
    (bad / "manifest.json").write_text(json.dumps(m))
    (bad / "state.json").unlink()
    (bad / "state.json").symlink_to("/etc/passwd")
    r = launch_child(run_dir)
    assert "JSONDecodeError" not in r.stderr
    assert_resumed_from_the_previous_one(run_dir, r, "the manifest does not list state.json")
