"""`worker.settings(**defaults)`: the knob values for this attempt (contract 1)."""

from __future__ import annotations

import json
import os
from typing import Any

from supervisor.protocol import ENV_SETTINGS


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
    raw = os.environ.get(ENV_SETTINGS)
    given: dict[str, Any] = {}
    if raw:
        try:
            given = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{ENV_SETTINGS} is not valid JSON ({e})") from None
        if not isinstance(given, dict):
            raise ValueError(f"{ENV_SETTINGS} must be a JSON object")
    out = Settings(defaults)
    for k, v in given.items():
        out[k] = _coerce(defaults.get(k), v)
    return out


def current() -> dict[str, Any]:
    raw = os.environ.get(ENV_SETTINGS)
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {}
