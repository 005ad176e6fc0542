"""Knob templates in the child's arguments: `--bs {batch_size}` gets this attempt's value, so
scripts that do not use the worker library get degraded settings too."""

from __future__ import annotations

import json
import re
from typing import Any

from rtrain.supervisor.core.errors import ConfigError

_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if value is None:
        return ""
    return str(value)


def render(argv: list[str], values: dict[str, Any]) -> list[str]:
    """Replace `{name}` with values[name]; any other brace text (JSON, globs) is left alone
    unless it looks like a template naming an unknown knob, which is a typo to report."""
    out = []
    for arg in argv:
        def sub(m: re.Match[str], arg: str = arg) -> str:
            name = m.group(1)
            if name not in values:
                known = ", ".join(sorted(values)) or "none"
                raise ConfigError(f"argument {arg!r} uses {{{name}}} but there is no setting of "
                                  f"that name (settings: {known}): add it under [settings] in "
                                  "rtrain.toml or fix the name")
            return _text(values[name])

        out.append(_FIELD.sub(sub, arg))
    return out


def names(argv: list[str]) -> set[str]:
    return {m.group(1) for arg in argv for m in _FIELD.finditer(arg)}
