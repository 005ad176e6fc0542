"""Where the run in the current directory lives, for commands given no DIR.

Precedence (first found wins): `rtrain.toml` (top level or its `[rtrain]` table, as in
supervisor/config.py), then `[tool.rtrain]` in `pyproject.toml`, then the default. Checkpoints:
`ckpt_dir` wins over `run_dir` + "/checkpoints"; the default is `./checkpoints` or, where only
that exists, `./rtrain-run/checkpoints` (where an unconfigured `rtrain launch` puts them). Run
dir: `run_dir`, default `./rtrain-run` (config.Config's default). Relative paths are relative to
the directory holding the file. This reads only those keys, so that `inspect` and `status` start
without the full config module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from supervisor.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


def _read_toml(path: Path) -> dict[str, Any] | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConfigError(f"cannot read {path} ({e.strerror})") from None
    try:
        return tomllib.loads(raw.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid TOML ({e}): fix or remove it") from None


def _tables(base: Path) -> list[tuple[dict[str, Any], str]]:
    """The rtrain tables of `base`, in precedence order, with a name for messages."""
    found = []
    rtrain_toml = _read_toml(base / "rtrain.toml")
    if rtrain_toml is not None:
        inner = rtrain_toml.get("rtrain")
        if isinstance(inner, dict):
            found.append((inner, "rtrain.toml [rtrain]"))
        else:
            found.append((rtrain_toml, "rtrain.toml"))
    pyproject = _read_toml(base / "pyproject.toml")
    if pyproject is not None:
        table = pyproject.get("tool", {}).get("rtrain")
        if isinstance(table, dict):
            found.append((table, "pyproject.toml [tool.rtrain]"))
    return found


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
    for table, source in _tables(base):
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
    for table, source in _tables(base):
        found = _path_from(table, "run_dir", base, source)
        if found is not None:
            return found
    return base / "rtrain-run"
