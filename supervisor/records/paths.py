"""Where the run in the current directory lives, for commands given no DIR.

The file is the one `rtrain launch` reads (core/config_file.py: `rtrain.toml`, else `[tool.rtrain]`
in `pyproject.toml`), so a command finds the run that launch made there. Checkpoints:
`ckpt_dir` wins over `run_dir` + "/checkpoints"; the default is `./checkpoints` or, where only
that exists, `./rtrain-run/checkpoints` (where an unconfigured `rtrain launch` puts them). Run
dir: `run_dir`, default `./rtrain-run` (config.Config's default). Relative paths are relative to
the directory holding the file. This reads only those keys, so that `inspect` and `status` start
without the full config module.

Run from inside a run dir (it holds `events.jsonl` or `state.json`), a command finds that run:
its run dir is the current directory, its checkpoints are where its first launch put them
(`run_ckpt_dir`), whatever a config file above would say.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.config_file import find_config
from rtrain.supervisor.core.errors import ConfigError

RUN_FILES = ("events.jsonl", "state.json")  # a directory holding one is a run dir
HEAD_BYTES = 1 << 18  # the first launch opens events.jsonl: its head is enough to find it


def is_run_dir(path: Path) -> bool:
    # lexists: a link planted at a name is a run's file refused when read, not "no run".
    return any(os.path.lexists(path / name) for name in RUN_FILES)


def run_ckpt_dir(run_dir: Path) -> Path:
    """Where the run in `run_dir` keeps its checkpoints: as its first launch recorded it
    (`--ckpt-dir`), else `run_dir/checkpoints`."""
    try:
        opened = ownfiles.open_own(run_dir / "events.jsonl")
    except (OSError, ownfiles.RefusedFile):
        return run_dir / "checkpoints"
    try:
        head = os.read(opened.fd, HEAD_BYTES)
    finally:
        os.close(opened.fd)
    for line in head.split(b"\n"):
        if b'"launch"' not in line:
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("kind") == "launch":
            where = event.get("ckpt_dir")
            return run_dir / where if isinstance(where, str) and where else (
                run_dir / "checkpoints")
    return run_dir / "checkpoints"


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
    if is_run_dir(base):
        return run_ckpt_dir(base)
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
    if is_run_dir(base):
        return base
    source, table = find_config(None, base)
    return _path_from(table, "run_dir", base, source) or base / "rtrain-run"
