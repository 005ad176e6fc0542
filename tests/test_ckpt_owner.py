"""rtrain's own files stay out of a checkpoint dir that belongs to the script: the launch loop
(scripted child) with `--ckpt-dir .` beside train.py and with `--resume-arg`, against the
default dir, where the Checkpointer needs them."""

from __future__ import annotations

import os

import pytest
from scripted_loop import Script, crash, success

from rtrain.supervisor.config import load_config
from rtrain.supervisor.launch.ckpt_owner import script_owns
from rtrain.supervisor.launch.loop import LaunchSpec
from rtrain.supervisor.launch.loop import launch as launch_loop

OWN = {".rtrain-run", ".rtrain-generation"}


@pytest.mark.parametrize("ckpt_dir, resume_args, owned", [
    (".", (), True),                                # --ckpt-dir . beside train.py
    ("out", ("--resume", "{checkpoint}"), True),    # a script that takes its checkpoint
    (None, (), False),                              # rtrain's default, a Checkpointer's dir
    ("ckpts", (), False),
])
def test_a_script_s_own_dir_gets_none_of_rtrain_s_files(tmp_path, ckpt_dir, resume_args, owned):
    overrides = {"run_dir": tmp_path / "run", "backoff.enabled": False}
    if ckpt_dir is not None:
        overrides["ckpt_dir"] = tmp_path / ckpt_dir
    script = Script([crash(), success()])
    spec = LaunchSpec(command=["train.py"], config=load_config(overrides, None, tmp_path),
                      echo=False, cwd=tmp_path, resume_args=resume_args)
    assert launch_loop(spec, script.seams()) == 0
    where = tmp_path / (ckpt_dir or "run/checkpoints")
    assert OWN & set(os.listdir(where)) == (set() if owned else OWN)
    assert not OWN & set(os.listdir(tmp_path / "run"))
    generation = [c.spec.env.get("RTRAIN_GENERATION") for c in script.spawned]
    assert all(g is None for g in generation) if owned else all(generation)
    # The run identity is still the run's, in every attempt.
    assert len({c.spec.env["RTRAIN_RUN_ID"] for c in script.spawned}) == 1


def test_the_script_s_folder_is_its_own(tmp_path):
    (tmp_path / "src").mkdir()
    owns = lambda d, cmd=("python", "src/train.py"), args=(): script_owns(  # noqa: E731
        tmp_path / d, command=list(cmd), resume_args=args, cwd=tmp_path)
    assert owns("src") and owns(".") and owns("out", args=("--resume",))
    assert owns("out", cmd=("python", "t.py", "--from", "{checkpoint}"))
    assert not owns("out") and not owns("src/checkpoints")
