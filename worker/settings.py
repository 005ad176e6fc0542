"""`rtrain.settings(**defaults)`: the knob values for this attempt (contract 1)."""

from __future__ import annotations

import json
import os
from typing import Any

from rtrain.supervisor.core.protocol import ENV_SETTINGS


class Settings(dict):
    """A dict whose keys also read as attributes: `s.batch_size`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}; known: {sorted(self)}") from None


def _coerce(default: Any, value: Any) -> Any:
    # Keep the script's types: a knob declared as int stays an int after halving.
    if isinstance(default, bool) or default is None:
        return value
    if isinstance(default, int) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    if isinstance(default, float) and isinstance(value, (int, float)):
        return float(value)
    return value


def settings(**defaults: Any) -> Settings:
    """The script's defaults overlaid with the supervisor's values from RTRAIN_SETTINGS."""
    out = Settings(defaults)
    for k, v in from_env(strict=True).items():
        out[k] = _coerce(defaults.get(k), v)
    return out


def current() -> dict[str, Any]:
    """The supervisor's values as given, for code that reads them in passing (guards, faults):
    a bad value reads as none rather than stopping training there."""
    return from_env(strict=False)


def from_env(*, strict: bool) -> dict[str, Any]:
    """RTRAIN_SETTINGS as a dict ({} when unset). `strict`: a value that is not a JSON object
    raises ValueError saying so; else it reads as {}."""
    raw = os.environ.get(ENV_SETTINGS)
    if not raw:
        return {}
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as e:
        if strict:
            raise ValueError(f"{ENV_SETTINGS} is not valid JSON ({e})") from None
        return {}
    if not isinstance(given, dict):
        if strict:
            raise ValueError(f"{ENV_SETTINGS} must be a JSON object")
        return {}
    return given
