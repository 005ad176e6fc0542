"""One config-file lookup for `rtrain launch` and for the commands given no DIR: rtrain.toml,
else [tool.rtrain] in pyproject.toml, one file whole (supervisor/config.py)."""

from __future__ import annotations

import pytest

from rtrain.supervisor.config import load_config
from rtrain.supervisor.core.config_file import find_config
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.records.paths import default_ckpt_dir, default_run_dir

PYPROJECT = '[project]\nname = "x"\n[tool.rtrain]\nrun_dir = "from-pyproject"\n'


def test_pyproject_is_read_when_there_is_no_rtrain_toml(tmp_path):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    assert find_config(None, tmp_path) == ("pyproject.toml [tool.rtrain]",
                                           {"run_dir": "from-pyproject"})
    assert load_config({}, None, tmp_path).run_dir == tmp_path / "from-pyproject"
    assert default_run_dir(tmp_path) == tmp_path / "from-pyproject"


def test_an_rtrain_toml_wins_whole_even_without_the_key(tmp_path):
    # launch reads rtrain.toml alone; status and prune must look where launch put the run.
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    (tmp_path / "rtrain.toml").write_text("[restart]\nmax_restarts = 2\n")
    assert find_config(None, tmp_path)[0] == "rtrain.toml"
    assert load_config({}, None, tmp_path).run_dir == tmp_path / "rtrain-run"
    assert default_run_dir(tmp_path) == tmp_path / "rtrain-run"
    assert default_ckpt_dir(tmp_path) == tmp_path / "checkpoints"


def test_config_option_beats_both(tmp_path):
    (tmp_path / "rtrain.toml").write_text('run_dir = "a"\n')
    (tmp_path / "other.toml").write_text('[rtrain]\nrun_dir = "b"\n')
    assert find_config(tmp_path / "other.toml", tmp_path) == ("other.toml", {"run_dir": "b"})


def test_keys_outside_the_rtrain_table_are_refused_by_every_reader(tmp_path):
    (tmp_path / "rtrain.toml").write_text('stray = 1\n[rtrain]\nrun_dir = "a"\n')
    for read in (lambda: load_config({}, None, tmp_path), lambda: default_run_dir(tmp_path)):
        with pytest.raises(ConfigError, match=r"keys \['stray'\] sit outside \[rtrain\]"):
            read()


def test_no_file_means_defaults(tmp_path):
    assert find_config(None, tmp_path) == ("defaults", {})
