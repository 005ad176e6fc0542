"""Which file configures the run in a directory, and its rtrain table: read by `rtrain launch`
(config.py) and by the commands given no DIR (records/paths.py), so both find the same run.

Precedence, one file wins whole (files never merge): `--config FILE`; else `rtrain.toml` in the
directory (top level, or all of it under `[rtrain]`); else `[tool.rtrain]` in `pyproject.toml`;
else none (defaults). An `rtrain.toml` that exists is the source even where it leaves a key out:
`pyproject.toml` is then not read. Light on purpose (tomllib only), so that `status` and
`inspect` start without the full config module.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

RTRAIN_TOML = "rtrain.toml"
PYPROJECT = "pyproject.toml"


def find_config(config_file: Path | None, cwd: Path) -> tuple[str, dict[str, Any]]:
    """The config source's name (for messages) and its rtrain table; ("defaults", {}) if none."""
    cwd = Path(cwd)
    if config_file is not None:
        path = cwd / config_file
        if not path.is_file():
            raise ConfigError(f"config file {path} not found; fix --config or remove it")
    elif (cwd / RTRAIN_TOML).is_file():
        path = cwd / RTRAIN_TOML
    elif (cwd / PYPROJECT).is_file():
        path = cwd / PYPROJECT
    else:
        return "defaults", {}
    doc = _read_toml(path)
    if path.name == PYPROJECT:
        table = doc.get("tool", {}).get("rtrain", {})
        return f"{path.name} [tool.rtrain]", table if isinstance(table, dict) else {}
    if isinstance(doc.get("rtrain"), dict):
        if len(doc) > 1:
            extra = sorted(k for k in doc if k != "rtrain")
            raise ConfigError(f"{path.name}: keys {extra} sit outside [rtrain]; put everything "
                              "under [rtrain] or nothing")
        return path.name, doc["rtrain"]
    return path.name, doc


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path.name}: not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}") from None
