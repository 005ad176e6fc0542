"""`rtrain status` names the checkpoint `rtrain launch` resumes from, on checkpoint dirs where
the two used to disagree: status picked over rtrain's own checkpoints only and ignored the ones a
worker of the run could not load, while launch picks over every format and passes over those.
The launch is the real loop with a scripted child (no process starts)."""

from __future__ import annotations

from pathlib import Path

from scripted_loop import Script, run, success
from test_foreign_verify import hf_checkpoint

from rtrain.checkpoint.verify import select_rtrain_resume
from rtrain.supervisor.ckpt import foreign
from rtrain.supervisor.commands.status import summarize
from rtrain.supervisor.decide.policy import History
from rtrain.supervisor.records.runstate import RunState, save_state


def resumed_by_launch(tmp_path: Path) -> str | None:
    _, events = run(tmp_path, Script([success()]))
    [launch] = [e for e in events if e["kind"] == "launch"]
    return launch["resume_from"] and Path(launch["resume_from"]).name


def test_a_trainer_checkpoint_newer_than_rtrains_own(tmp_path, make_ckpt):
    ckpts = tmp_path / "run" / "checkpoints"
    make_ckpt(ckpts, 200)
    hf_checkpoint(ckpts, 400)
    assert select_rtrain_resume(ckpts, "quick").chosen.path.name == "checkpoint-200"  # old pick
    assert resumed_by_launch(tmp_path) == "checkpoint-400"
    s = summarize(tmp_path / "run")
    assert s.checkpoint.name == "checkpoint-400" and s.checkpoint_step == 400


def test_a_checkpoint_the_worker_could_not_load(tmp_path, make_ckpt):
    ckpts = tmp_path / "run" / "checkpoints"
    for step in (200, 300):
        make_ckpt(ckpts, step)
    [newest] = [v for v in foreign.verify_all(ckpts) if v.step == 300]
    history = History(attempt=1, bad_checkpoints=(foreign.resume_identity(newest),))
    save_state(tmp_path / "run", RunState(command=["train.py", "--attempt", "{attempt}"],
                                          cwd=str(tmp_path), history=history))
    assert select_rtrain_resume(ckpts, "quick").chosen.path.name == "checkpoint-300"  # old pick
    assert resumed_by_launch(tmp_path) == "checkpoint-200"
    s = summarize(tmp_path / "run")
    assert s.checkpoint.name == "checkpoint-200" and s.checkpoint_step == 200
