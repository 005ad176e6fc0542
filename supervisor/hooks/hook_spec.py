"""`[[hooks]]` tables of the config file: what a hook is and how its table is checked.

Parsed with the rest of the configuration (config.py), run by hooks/runner.py. Kept apart
from the runner so that reading a config never imports process-running code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rtrain.supervisor.core.errors import ConfigError, did_you_mean
from rtrain.supervisor.core.event_schema import HOOKABLE_KINDS, Kind
from rtrain.supervisor.decide.failures import FailureKind

# Event kinds a hook may name come from the events schema (hook_failed is not one of them: a
# hook on its own failures could loop), then failure kinds.
HOOKABLE = tuple(dict.fromkeys([*HOOKABLE_KINDS, *(k.value for k in FailureKind)]))


@dataclass(frozen=True, kw_only=True, slots=True)
class HookSpec:
    """One `[[hooks]]` table."""

    on: tuple[str, ...]
    """Event kinds (give_up, degrade, launch, ...) or failure kinds (hang, oom_gpu, ...)."""
    command: tuple[str, ...]
    """argv of the command, run without a shell; the event's JSON arrives on stdin."""
    timeout_s: float = 10.0
    """Seconds the command may run before its process group is killed (a `hook_failed`)."""

    def matches(self, event: dict[str, Any]) -> bool:
        kind = event.get("kind")
        return kind in self.on or (kind == Kind.CLASSIFICATION
                                   and event.get("failure") in self.on)


def parse_hooks(raw: Any) -> tuple[HookSpec, ...]:
    """`[[hooks]]` tables from the config file, validated; errors say what to change."""
    if not isinstance(raw, list):
        raise ConfigError("hooks must be an array of tables: [[hooks]] on = [...] command = [...]")
    hooks = []
    for i, table in enumerate(raw):
        where = f"[[hooks]] #{i + 1}"
        if not isinstance(table, dict):
            raise ConfigError(f"{where} must be a table with on, command and timeout_s")
        for key in table:
            if key not in ("on", "command", "timeout_s"):
                did = did_you_mean(key, ("on", "command", "timeout_s"))
                raise ConfigError(f"unknown key {key!r} in {where}{did}")
        on = table.get("on")
        if isinstance(on, str):
            on = [on]
        if not on or not isinstance(on, list) or not all(isinstance(k, str) for k in on):
            raise ConfigError(f"{where}: on must list event kinds, e.g. on = [\"give_up\", "
                              "\"degrade\", \"hang\"]")
        for name in on:
            if name not in HOOKABLE:
                did = did_you_mean(name, HOOKABLE, otherwise=f" (known: {', '.join(HOOKABLE)})")
                raise ConfigError(f"{where}: {name!r} is not an event or failure kind{did}")
        command = table.get("command")
        if (not isinstance(command, list) or not command
                or not all(isinstance(a, str) and a for a in command)):
            raise ConfigError(f"{where}: command must be a non-empty list of strings (argv, no "
                              "shell), e.g. command = [\"notify-send\", \"rtrain\"]")
        timeout = table.get("timeout_s", 10.0)
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not math.isfinite(timeout) or timeout <= 0):
            raise ConfigError(f"{where}: timeout_s must be a number of seconds above 0 (finite) "
                              f"(got {timeout!r})")
        hooks.append(HookSpec(on=tuple(on), command=tuple(command), timeout_s=float(timeout)))
    return tuple(hooks)
