"""One owner per setting: config.py's dataclasses. `rtrain launch --help` and the runtime
objects built from them (WatchConfig, HangPolicy) must agree with them; docs/reference.md is
generated from them (tests/test_reference.py)."""

from __future__ import annotations

import dataclasses
import re
import signal
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from rtrain.supervisor import cli
from rtrain.supervisor.config import (
    BackoffConfig,
    Config,
    HangConfig,
    PressureConfig,
    RestartConfig,
    SlurmConfig,
    StragglerConfig,
)
from rtrain.supervisor.proc.heartbeat import HangPolicy
from rtrain.supervisor.proc.watch import WatchConfig

if sys.version_info >= (3, 11):
    pass
else:  # pragma: no cover
    pass

SECTIONS = {"restart": RestartConfig, "backoff": BackoffConfig, "hang": HangConfig,
            "slurm": SlurmConfig, "pressure": PressureConfig, "straggler": StragglerConfig}

# `rtrain launch` options that set a config key (dotted: in its table); the rest set none.
CONFIG_OPTIONS = {
    "--resume": "resume", "--run-dir": "run_dir", "--ckpt-dir": "ckpt_dir",
    "--max-restarts": "restart.max_restarts", "--grace": "grace_s",
    "--stop-signal": "stop_signal", "--hang-timeout": "hang.timeout_s", "--set": "settings",
    "--requeue": "requeue", "--no-backoff": "backoff.enabled", "--metrics-file": "metrics_file",
    "--mirror": "mirror", "--keep-remote": "keep_remote", "--no-standby": "standby",
}
OTHER_OPTIONS = {"script", "--module", "--resume-arg", "--config", "--fresh",
                 "--retry", "--quiet", "--python", "--nproc-per-node", "--nnodes",
                 "--rdzv-endpoint", "--rdzv-backend", "--help"}
# (option, value on the command line, what the config then holds) for the mapping test
EXAMPLES = {
    "--resume": ("never", "never"), "--run-dir": ("r", "r"), "--ckpt-dir": ("c", "c"),
    "--max-restarts": ("7", 7), "--grace": ("7.5", 7.5), "--stop-signal": ("USR1", "SIGUSR1"),
    "--hang-timeout": ("99", 99.0), "--set": ("batch_size=8", {"batch_size": 8}),
    "--requeue": (None, True), "--no-backoff": (None, False), "--metrics-file": ("m", "m"),
    "--mirror": ("s3://b/p", "s3://b/p"), "--keep-remote": ("5", 5),
    "--no-standby": (None, False),
}


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _show(value) -> str:
    """A default as docs and help write it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# ------------------------------------------------------------------ rtrain launch --help

def launch_params() -> dict[str, object]:
    command = typer.main.get_command(cli.app).commands["launch"]
    out = {}
    for param in command.params:
        names = [o for o in param.opts if o.startswith("--")] or [param.name]
        for name in names:
            out[name] = param
        for name in getattr(param, "secondary_opts", []):
            out[name] = param
    return out


def test_every_launch_option_is_a_config_key_or_known_not_to_be():
    params = launch_params()
    unknown = set(params) - set(CONFIG_OPTIONS) - OTHER_OPTIONS - {"--no-requeue"}
    assert not unknown, f"classify these options in CONFIG_OPTIONS or OTHER_OPTIONS: {unknown}"
    defaults = Config()
    for option, key in CONFIG_OPTIONS.items():
        assert option in params, f"{option} is gone from rtrain launch"
        _get(defaults, key)  # raises when the key is not a config field


@pytest.mark.parametrize("option", sorted(CONFIG_OPTIONS))
def test_launch_help_states_the_config_default(option):
    value = _get(Config(), CONFIG_OPTIONS[option])
    if value is None or isinstance(value, (bool, dict)):
        return  # no default to state: unset, a switch, or knobs of the user's own
    help_text = launch_params()[option].help
    said = help_text.lower().replace("default:", "default")
    assert f"default {_show(value)}".lower() in said, (
        f"{option}: help should say 'default {_show(value)}' (config.py): {help_text!r}")


def test_launch_help_mentions_of_other_keys_state_their_defaults():
    defaults = Config()
    keys = {f.name: f.name for f in dataclasses.fields(Config)}
    for section in SECTIONS:
        keys.update({f.name: f"{section}.{f.name}"
                     for f in dataclasses.fields(SECTIONS[section]) if f.init})
    for option, param in launch_params().items():
        for name, shown in re.findall(r"\b(\w+) \(([^)]*)\)", param.help or ""):
            if name in keys and not isinstance(_get(defaults, keys[name]), dict):
                assert shown == _show(_get(defaults, keys[name])), (
                    f"{option} help says {name} ({shown}); config.py: "
                    f"{_get(defaults, keys[name])!r}")


@pytest.mark.parametrize("option", sorted(CONFIG_OPTIONS))
def test_launch_option_sets_its_config_key(option, monkeypatch, tmp_path):
    seen = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("rtrain.supervisor.launch.loop.launch", lambda spec: seen.append(spec) or 0)
    given, expected = EXAMPLES[option]
    args = ["launch", option, *([] if given is None else [given]), "-m", "train"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    value = _get(seen[0].config, CONFIG_OPTIONS[option])
    if isinstance(value, Path):
        value = value.relative_to(tmp_path).as_posix()
    assert value == expected


# ------------------------------------------------------------------ runtime objects

def test_runtime_objects_have_no_defaults_for_settings():
    for cls, names in ((WatchConfig, ("stop_signal", "grace_s", "sample_interval_s", "hang",
                                      "pressure", "hang_grace_s")),
                       (HangPolicy, [f.name for f in dataclasses.fields(HangPolicy)])):
        for f in dataclasses.fields(cls):
            if f.name in names:
                assert f.default is dataclasses.MISSING, f"{cls.__name__}.{f.name} has a default"
                assert f.default_factory is dataclasses.MISSING, f"{cls.__name__}.{f.name}"


def test_functions_that_take_a_setting_have_no_default_for_it():
    import inspect

    from rtrain.supervisor.decide.classify import classify
    from rtrain.supervisor.proc.logcap import CappedLog

    param = inspect.signature(classify).parameters["memory_pressure_fraction"]
    assert param.default is inspect.Parameter.empty
    assert inspect.signature(CappedLog).parameters["cap_bytes"].default is inspect.Parameter.empty


def test_watch_config_is_built_from_every_setting_it_uses():
    cfg = Config(stop_signal="SIGUSR1", grace_s=7.0, sample_interval_s=0.25,
                 hang=HangConfig(timeout_s=11.0, multiple=3.0, warmup_steps=4, floor_s=2.0,
                                 ceiling_s=9.0, save_allowance_s=5.0, grace_s=3.0))
    watch = WatchConfig.from_config(cfg)
    assert (watch.stop_signal, watch.grace_s, watch.sample_interval_s, watch.hang_grace_s) == (
        signal.SIGUSR1, 7.0, 0.25, 3.0)
    assert watch.hang == HangPolicy(startup_s=11.0, plain_timeout_s=11.0, warmup_steps=4,
                                    multiple=3.0, floor_s=2.0, ceiling_s=9.0,
                                    save_allowance_s=5.0)


def test_every_hang_setting_reaches_the_policy():
    # a new [hang] key must be wired into HangPolicy.from_config (or this list of exceptions)
    policy_names = {f.name for f in dataclasses.fields(HangPolicy)}
    for f in dataclasses.fields(HangConfig):
        changed = dataclasses.replace(HangConfig(), **{f.name: getattr(HangConfig(), f.name) * 2})
        if f.name == "grace_s":  # not the clock's: the stop of a hung child (WatchConfig)
            assert WatchConfig.from_config(Config(hang=changed)).hang_grace_s == f.default * 2
            continue
        assert HangPolicy.from_config(changed) != HangPolicy.from_config(HangConfig()), f.name
        if f.name != "timeout_s":
            assert f.name in policy_names, f"HangPolicy names [hang] {f.name} differently"


def test_a_zero_save_allowance_is_accepted_by_both():
    assert HangPolicy.from_config(HangConfig(save_allowance_s=0)).save_allowance_s == 0
