"""Where the run in the current directory keeps its checkpoints, for commands given no DIR.

Precedence (first found wins): `rtrain.toml`, then `[tool.rtrain]` in `pyproject.toml`, then
`./checkpoints`. In either table, `ckpt_dir` wins over `run_dir` + "/checkpoints"; relative
paths are relative to the directory holding the file. This reads only those two keys so that
the full config module can replace it without changing callers.
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


def _ckpt_dir_from(table: dict[str, Any], base: Path, source: str) -> Path | None:
    for key, suffix in (("ckpt_dir", ""), ("run_dir", "checkpoints")):
        value = table.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{source}: {key} must be a non-empty string path, "
                              f"not {value!r}")
        return base / value / suffix if suffix else base / value
    return None


def default_ckpt_dir(cwd: str | Path | None = None) -> Path:
    """The checkpoint directory of the run in `cwd` (default: the current directory)."""
    base = Path.cwd() if cwd is None else Path(cwd)
    rtrain_toml = _read_toml(base / "rtrain.toml")
    if rtrain_toml is not None:
        found = _ckpt_dir_from(rtrain_toml, base, "rtrain.toml")
        if found is not None:
            return found
    pyproject = _read_toml(base / "pyproject.toml")
    if pyproject is not None:
        table = pyproject.get("tool", {}).get("rtrain")
        if isinstance(table, dict):
            found = _ckpt_dir_from(table, base, "pyproject.toml [tool.rtrain]")
            if found is not None:
                return found
    return base / "checkpoints"
