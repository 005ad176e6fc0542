"""Configuration: precedence CLI > file > defaults, and errors that say what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from rtrain.supervisor.config import DEFAULT_BUDGETS, load_config
from rtrain.supervisor.core.errors import ConfigError, ExitCode
from rtrain.supervisor.decide.ladder import DEFAULT_LADDER, Action


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_without_any_file(tmp_path):
    cfg = load_config({}, None, tmp_path)
    assert cfg.run_dir == tmp_path / "rtrain-run"
    assert cfg.ckpt_dir == tmp_path / "rtrain-run" / "checkpoints"
    assert (cfg.resume, cfg.verify, cfg.stop_signal, cfg.grace_s) == ("auto", "full", "SIGTERM", 30)
    assert cfg.restart.budgets == DEFAULT_BUDGETS
    assert cfg.restart.budgets["oom"] == 6 and cfg.restart.crash_loop_k == 3
    assert cfg.ladder == DEFAULT_LADDER
    assert cfg.settings == {}


def test_precedence_cli_over_file_over_defaults(tmp_path):
    write(tmp_path, "rtrain.toml", """
run_dir = "runs/a"
grace_s = 12
[restart]
max_restarts = 7
give_up_on_rate = true
[restart.budgets]
crash = 9
[settings]
batch_size = 64
resolution = 224
""")
    cfg = load_config({"max_restarts": 2, "run_dir": None, "backoff.enabled": False,
                       "settings": {"batch_size": 16}}, None, tmp_path)
    assert cfg.restart.max_restarts == 2  # CLI
    assert cfg.restart.give_up_on_rate is True  # file, same table as a CLI override
    # the file's budget kept; the others follow the explicit max_restarts, never cap it
    assert cfg.restart.budgets == {**dict.fromkeys(DEFAULT_BUDGETS, 2), "crash": 9}
    assert cfg.run_dir == tmp_path / "runs/a"  # None on the CLI means "not given"
    assert cfg.ckpt_dir == tmp_path / "runs/a/checkpoints"
    assert cfg.grace_s == 12
    assert cfg.backoff.enabled is False and cfg.backoff.initial_s == 1.0
    assert cfg.settings == {"batch_size": 16, "resolution": 224}


def test_rtrain_table_in_rtrain_toml(tmp_path):
    write(tmp_path, "rtrain.toml", '[rtrain]\nresume = "never"\n[rtrain.hang]\ntimeout_s = 90\n')
    cfg = load_config({}, None, tmp_path)
    assert cfg.resume == "never" and cfg.hang.timeout_s == 90


def test_pyproject_tool_rtrain(tmp_path):
    write(tmp_path, "pyproject.toml", """
[project]
name = "x"
[tool.rtrain]
stop_signal = "usr1"
requeue = true
[[tool.rtrain.ladder]]
knob = "seq_len"
action = "scale"
factor = 0.5
floor = 256
""")
    cfg = load_config({}, None, tmp_path)
    assert cfg.stop_signal == "SIGUSR1" and cfg.requeue is True
    assert len(cfg.ladder) == 1 and cfg.ladder[0].action is Action.SCALE


def test_rtrain_toml_wins_over_pyproject(tmp_path):
    write(tmp_path, "pyproject.toml", "[tool.rtrain]\ngrace_s = 1\n")
    write(tmp_path, "rtrain.toml", "grace_s = 2\n")
    assert load_config({}, None, tmp_path).grace_s == 2


def test_explicit_config_file_and_resume_path(tmp_path):
    write(tmp_path, "other.toml", 'resume = "ck/checkpoint-10"\nckpt_dir = "/abs/ck"\n')
    cfg = load_config({}, Path("other.toml"), tmp_path)
    assert cfg.resume == str(tmp_path / "ck/checkpoint-10")
    assert cfg.ckpt_dir == Path("/abs/ck")


@pytest.mark.parametrize(("text", "message"), [
    ("[restart]\nmax_restart = 3\n",
     "rtrain.toml: unknown key 'max_restart' in [restart] (did you mean 'max_restarts'?)"),
    ("max_restarts = 3\n", "key 'max_restarts' does not belong in the top level; put it under "
                           "[restart]"),
    ("[restart.budgets]\ncrsh = 1\n", "unknown key 'crsh' in [restart.budgets] (did you mean "
                                      "'crash'?)"),
    ("grace_s = -1\n", "rtrain.toml: grace_s must be at least 0 (got -1)"),
    ("grace_s = \"30\"\n", "grace_s must be a number"),
    ("stop_signal = \"SIGFOO\"\n", "stop_signal 'SIGFOO' is not a signal"),
    # A tuning constant is the code's, not a setting: refused with the value rtrain keeps.
    ("[backoff]\njitter = 0.5\n", "[backoff] jitter is not a setting: rtrain holds it at 0.25"),
    ("[hang]\nfloor_s = 100\n", "[hang] floor_s is not a setting: rtrain holds it at 60.0 "
     "(docs/reference.md lists the settings); remove it"),
    ("[straggler]\nenabled = false\n", "[straggler] enabled is not a setting: rtrain holds it "
     "at true"),
    ("log_cap_mb = 1\n", "log_cap_mb is not a setting: rtrain holds it at 64.0"),
    ("[restart]\ntimeout_s = 5\n", "'timeout_s' does not belong in [restart]; put it under "
     "[hang]"),
    ("verify = \"fast\"\n", "verify must be 'quick' or 'full'"),
    ("resume = 3\n", "resume must be auto, never or a checkpoint path (got 3)"),
    ("requeue = 1\n", "requeue must be true or false"),
    ("[settings]\nwhen = 1979-05-27\n", "[settings] when must be a string, number"),
    ("[[ladder]]\nknob = \"batch_size\"\naction = \"shrink\"\n", "action 'shrink' is not one of"),
    ("grace_s = \n", "rtrain.toml: not valid TOML"),
])
def test_file_errors_name_the_file_and_the_fix(tmp_path, text, message):
    write(tmp_path, "rtrain.toml", text)
    with pytest.raises(ConfigError) as err:
        load_config({}, None, tmp_path)
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert err.value.exit_code == ExitCode.USAGE


def test_cli_errors_name_the_command_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^command line: \[restart\] max_restarts must be at "
                                          r"least 0 \(got -1\)"):
        load_config({"max_restarts": -1}, None, tmp_path)


def test_missing_explicit_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope\.toml not found"):
        load_config({}, Path("nope.toml"), tmp_path)


def test_keys_outside_rtrain_table_are_refused(tmp_path):
    write(tmp_path, "rtrain.toml", "grace_s = 1\n[rtrain]\nrequeue = true\n")
    with pytest.raises(ConfigError, match="outside \\[rtrain\\]"):
        load_config({}, None, tmp_path)
