"""`rtrain prune` in a subprocess, and the no-DIR lookup of rtrain.supervisor.records.paths."""

from __future__ import annotations

import pytest
from harness import checkpoint_steps

from rtrain.checkpoint.layout import host_name
from rtrain.supervisor.records.paths import default_ckpt_dir


@pytest.fixture
def ckpts(tmp_path, make_ckpt):
    d = tmp_path / "checkpoints"
    for step, loss in ((100, 0.5), (200, 0.1), (300, 0.4), (400, 0.3), (500, 0.2)):
        make_ckpt(d, step, metrics={"loss": loss, "acc": 1 - loss})
    (d / f".tmp-checkpoint-600-{host_name()}-999999999-abcd1234").mkdir()
    return d


def test_keep_newest(rtrain, ckpts):
    r = rtrain("prune", str(ckpts), "--keep", "2")
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(ckpts) == [400, 500]
    lines = r.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines[:4]] == [["removed", f"checkpoint-{s}"]
                                                    for s in (300, 200, 100)] + [
        ["removed", f".tmp-checkpoint-600-{host_name()}-999999999-abcd1234"]]
    assert "beyond the retention policy" in lines[0] and "abandoned temp dir" in lines[3]
    assert lines[-1].startswith("freed ") and "KiB" in lines[-1]
    assert lines[-1].endswith("kept 2 checkpoints: checkpoint-500, checkpoint-400")


@pytest.mark.parametrize("mode, best", [("min", 200), ("max", 100)])
def test_keep_best(rtrain, ckpts, mode, best):
    r = rtrain("prune", str(ckpts), "--keep", "1", "--keep-best", "1", "--metric", "loss",
               "--mode", mode)
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(ckpts) == sorted({best, 500})


def test_milestones(rtrain, ckpts):
    assert rtrain("prune", str(ckpts), "--keep", "1", "--milestone-every", "200").returncode == 0
    assert checkpoint_steps(ckpts) == [200, 400, 500]


def test_dry_run_removes_nothing(rtrain, ckpts):
    r = rtrain("prune", str(ckpts), "--keep", "1", "--dry-run")
    assert r.returncode == 0
    assert checkpoint_steps(ckpts) == [100, 200, 300, 400, 500]
    assert r.stdout.count("would remove") == 5 and "would free" in r.stdout


def test_no_dir_uses_the_run_in_the_current_directory(rtrain, ckpts):
    r = rtrain("prune", "--keep", "3", cwd=ckpts.parent)
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(ckpts) == [300, 400, 500]


def test_corrupt_older_checkpoint_is_removed_with_its_reason(rtrain, ckpts):
    (ckpts / "checkpoint-100" / "state.json").unlink()
    r = rtrain("prune", str(ckpts), "--keep", "5")
    assert checkpoint_steps(ckpts) == [200, 300, 400, 500]
    assert "failed verification and a newer checkpoint verifies (corrupt: file 'state.json' " \
           "is missing)" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--keep", "2", "--keep-best", "1"], "--keep-best needs --metric"),
    (["--keep", "2", "--metric", "loss"], "only apply with --keep-best"),
    (["--keep", "0"], "--keep must be at least 1"),
    (["--keep", "1", "--milestone-every", "-5"], "must be 0 or more"),
])
def test_bad_combinations_are_one_line_exit_2(rtrain, ckpts, args, words):
    r = rtrain("prune", str(ckpts), *args)
    assert r.returncode == 2
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("rtrain: error: ")
    assert words in r.stderr
    assert checkpoint_steps(ckpts) == [100, 200, 300, 400, 500]


def test_missing_dir_and_checkpoint_given_as_dir(rtrain, ckpts):
    r = rtrain("prune", str(ckpts / "nope"), "--keep", "1")
    assert r.returncode == 2 and r.stderr.startswith("rtrain: error: no checkpoint directory")
    r = rtrain("prune", str(ckpts / "checkpoint-100"), "--keep", "1")
    assert r.returncode == 2 and "is one checkpoint" in r.stderr


def test_keep_is_required(rtrain, ckpts):
    r = rtrain("prune", str(ckpts))
    assert r.returncode == 2 and "Missing option '--keep'" in r.stderr


# --- rtrain.supervisor.records.paths --------------------------------------------------------------


def test_default_is_checkpoints_in_cwd(tmp_path):
    assert default_ckpt_dir(tmp_path) == tmp_path / "checkpoints"


def test_an_unconfigured_launch_run_is_found(tmp_path):
    (tmp_path / "rtrain-run" / "checkpoints").mkdir(parents=True)
    assert default_ckpt_dir(tmp_path) == tmp_path / "rtrain-run" / "checkpoints"
    (tmp_path / "checkpoints").mkdir()  # a ./checkpoints of its own still wins
    assert default_ckpt_dir(tmp_path) == tmp_path / "checkpoints"


def test_rtrain_toml_ckpt_dir_and_run_dir(tmp_path):
    (tmp_path / "rtrain.toml").write_text('run_dir = "runs/a"\n')
    assert default_ckpt_dir(tmp_path) == tmp_path / "runs/a/checkpoints"
    (tmp_path / "rtrain.toml").write_text('run_dir = "runs/a"\nckpt_dir = "/abs/ck"\n')
    assert str(default_ckpt_dir(tmp_path)) == "/abs/ck"


def test_pyproject_tool_rtrain(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.rtrain]\n'
                                             'ckpt_dir = "ck"\n')
    assert default_ckpt_dir(tmp_path) == tmp_path / "ck"
    (tmp_path / "rtrain.toml").write_text('ckpt_dir = "first"\n')  # rtrain.toml wins
    assert default_ckpt_dir(tmp_path) == tmp_path / "first"


def test_bad_value_is_a_config_error(tmp_path):
    from rtrain.supervisor.core.errors import ConfigError

    (tmp_path / "rtrain.toml").write_text("ckpt_dir = 3\n")
    with pytest.raises(ConfigError, match="ckpt_dir must be a non-empty string"):
        default_ckpt_dir(tmp_path)


def test_option_values_are_checked_and_enums_ignore_case(rtrain, ckpts):
    r = rtrain("prune", str(ckpts), "--keep", "abc")
    assert r.returncode == 2 and "'abc' is not a valid integer" in r.stderr
    r = rtrain("prune", str(ckpts), "--keep", "1", "--keep-best", "1", "--metric", "acc",
               "--mode", "MAX")
    assert r.returncode == 0, r.stderr
    assert checkpoint_steps(ckpts) == [200, 500]
