"""Where the run in the current directory lives, for commands given no DIR.

The file is the one `rtrain launch` reads (core/config_file.py: `rtrain.toml`, else `[tool.rtrain]`
in `pyproject.toml`), so a command finds the run that launch made there. Checkpoints:
`ckpt_dir` wins over `run_dir` + "/checkpoints"; the default is `./checkpoints` or, where only
that exists, `./rtrain-run/checkpoints` (where an unconfigured `rtrain launch` puts them). Run
dir: `run_dir`, default `./rtrain-run` (config.Config's default). Relative paths are relative to
the directory holding the file. This reads only those keys, so that `inspect` and `status` start
without the full config module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rtrain.supervisor.core.config_file import find_config
from rtrain.supervisor.core.errors import ConfigError


def _path_from(table: dict[str, Any], key: str, base: Path, source: str) -> Path | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{source}: {key} must be a non-empty string path, not {value!r}")
    return base / Path(value).expanduser()


def default_ckpt_dir(cwd: str | Path | None = None) -> Path:
    """The checkpoint directory of the run in `cwd` (default: the current directory)."""
    base = Path.cwd() if cwd is None else Path(cwd)
    source, table = find_config(None, base)
    for key, suffix in (("ckpt_dir", ""), ("run_dir", "checkpoints")):
        found = _path_from(table, key, base, source)
        if found is not None:
            return found / suffix if suffix else found
    # `rtrain launch` with no configuration keeps its checkpoints in ./rtrain-run/checkpoints:
    # `rtrain prune --keep 3` next to it must find them.
    launched = base / "rtrain-run" / "checkpoints"
    if launched.is_dir() and not (base / "checkpoints").is_dir():
        return launched
    return base / "checkpoints"


def default_run_dir(cwd: str | Path | None = None) -> Path:
    """The run directory of the run in `cwd` (default: the current directory)."""
    base = Path.cwd() if cwd is None else Path(cwd)
    source, table = find_config(None, base)
    return _path_from(table, "run_dir", base, source) or base / "rtrain-run"
