"""The degradation ladder: which knob to lower after a memory failure, and how to climb back.

Pure functions of data. Settings are a dict of JSON values (the knobs the child is given as
`RTRAIN_SETTINGS`). A ladder is an ordered list of rungs; a step down applies the first rung,
in order, whose knob is present in the settings and not yet at its floor, so a `halve` rung is
walked several times (64 -> 32 -> ... -> floor) before the next rung is tried. Every step
returns an undo record; climbing back one rung applies the newest one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rtrain.supervisor.core.errors import ConfigError, did_you_mean

Settings = dict[str, Any]


class Action(str, enum.Enum):
    HALVE = "halve"  # integer knobs: value // 2, down to the floor
    SCALE = "scale"  # value * factor (kept an int for int knobs), down to the floor
    ENABLE = "enable"  # boolean knob turned on (e.g. offload)
    DISABLE = "disable"  # boolean knob turned off (e.g. a memory-hungry cache)


# Knobs a halving rung may compensate, and how: grad_accum grows so the effective batch is kept;
# lr follows the linear scaling rule (lr proportional to batch size).
COMPENSATE = ("grad_accum", "lr")


@dataclass(frozen=True, kw_only=True, slots=True)
class Rung:
    """One rung of the ladder, as written in TOML under `[[ladder]]`."""

    knob: str
    """Settings key this rung lowers, e.g. "batch_size"; rungs whose knob is absent are skipped."""
    action: Action = Action.HALVE
    """halve | scale | enable | disable."""
    factor: float = 0.5
    """For `scale`: the multiplier, strictly between 0 and 1 (e.g. 0.75 for resolution)."""
    floor: float | None = None
    """Lowest value `halve`/`scale` may reach (default 1); the rung is spent there."""
    compensate: str | None = None
    """For a batch knob: "grad_accum" (grow it to keep the effective batch) or "lr" (scale it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.knob, str) or not self.knob:
            raise ConfigError("[[ladder]] knob must be a non-empty settings name, "
                              "e.g. 'batch_size'")
        try:
            object.__setattr__(self, "action", Action(self.action))
        except ValueError:
            names = [a.value for a in Action]
            did = did_you_mean(str(self.action), names)
            raise ConfigError(f"[[ladder]] knob={self.knob!r}: action {self.action!r} is not "
                              f"one of {', '.join(names)}{did}") from None
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not 0 < self.factor < 1:
            raise ConfigError(f"[[ladder]] knob={self.knob!r}: factor must be a number between 0 "
                              f"and 1 (got {self.factor!r})")
        if self.floor is not None and (isinstance(self.floor, bool)
                                       or not isinstance(self.floor, (int, float))
                                       or not math.isfinite(self.floor)):
            raise ConfigError(f"[[ladder]] knob={self.knob!r}: floor must be a finite number "
                              f"(got {self.floor!r})")
        if self.compensate is not None and self.compensate not in COMPENSATE:
            raise ConfigError(f"[[ladder]] knob={self.knob!r}: compensate must be one of "
                              f"{', '.join(COMPENSATE)} (got {self.compensate!r})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], index: int) -> Rung:
        known = [f for f in cls.__dataclass_fields__ if not f.startswith("_")]
        for key in raw:
            if key not in known:
                raise ConfigError(f"unknown key {key!r} in [[ladder]] #{index + 1}"
                                  f"{did_you_mean(key, known)}")
        if "knob" not in raw:
            raise ConfigError(f"[[ladder]] #{index + 1} needs a knob, e.g. knob = \"batch_size\"")
        return cls(**raw)

    @property
    def lowest(self) -> float:
        return 1 if self.floor is None else self.floor


DEFAULT_LADDER: tuple[Rung, ...] = (
    Rung(knob="batch_size", action=Action.HALVE, floor=1, compensate="grad_accum"),
    Rung(knob="resolution", action=Action.SCALE, factor=0.75, floor=64),
    Rung(knob="seq_len", action=Action.HALVE, floor=128),
    Rung(knob="offload", action=Action.ENABLE),
)


@dataclass(frozen=True, kw_only=True)
class Step:
    """One rung walked down: the new settings and what undoes it."""

    settings: Settings
    level: int
    description: str  # e.g. "batch_size 64 -> 32, grad_accum 1 -> 2 (effective batch kept: 64)"
    undo: dict[str, Any] = field(default_factory=dict)  # an undo record, see `step_up`


@dataclass(frozen=True)
class Floor:
    """No rung can lower anything further; `message` says where each knob stands."""

    message: str


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _lowered(rung: Rung, value: Any) -> Any:
    """The rung's next value for `value`, or None when the rung cannot lower it further."""
    if rung.action in (Action.ENABLE, Action.DISABLE):
        target = rung.action is Action.ENABLE
        return None if value is target else target
    if not _is_number(value) or value <= rung.lowest:
        return None
    new = value / 2 if rung.action is Action.HALVE else value * rung.factor
    floor: float = rung.lowest
    if isinstance(value, int):  # int knobs stay ints (a batch of 12.5 means nothing)
        new, floor = int(new), math.ceil(floor)
    new = max(new, floor)
    return None if new >= value else new


def _compensate(rung: Rung, settings: Settings, old: Any, new: Any) -> tuple[str, dict, dict]:
    """Apply the rung's compensation; returns (text, values to restore, ratios to divide by)."""
    knob = rung.compensate
    if knob is None:
        return "", {}, {}
    current = settings.get(knob)
    if not _is_number(current):
        return f" ({knob} not in settings: nothing compensates)", {}, {}
    if knob == "grad_accum":
        # Ceil, so the effective batch never shrinks when the halving is clamped by the floor.
        grown = math.ceil(old * current / new)
        settings[knob] = grown
        return (f", grad_accum {current} -> {grown} (effective batch {old * current} -> "
                f"{new * grown})", {knob: current}, {})
    ratio = new / old
    settings[knob] = current * ratio
    # lr is undone by ratio, not by value, so a later non-finite lr cut survives a step up.
    return f", lr {current:g} -> {settings[knob]:g} (linear scaling)", {}, {knob: ratio}


def step_down(settings: Settings, ladder: Sequence[Rung], level: int) -> Step | Floor:
    """Walk one rung down: the first applicable rung lowers its knob by one notch."""
    for rung in ladder:
        if rung.knob not in settings:
            continue
        old = settings[rung.knob]
        new = _lowered(rung, old)
        if new is None:
            continue
        out = dict(settings)
        out[rung.knob] = new
        text, restore, ratios = _compensate(rung, out, old, new)
        undo = {"set": {rung.knob: old, **restore}, "divide": ratios,
                "description": f"{rung.knob} {old} -> {new}{text}"}
        return Step(settings=out, level=level + 1, description=undo["description"], undo=undo)
    return Floor(message=_floor_message(settings, ladder))


def _floor_message(settings: Settings, ladder: Sequence[Rung]) -> str:
    parts = []
    for rung in ladder:
        if rung.knob not in settings:
            continue
        if rung.action in (Action.ENABLE, Action.DISABLE):
            parts.append(f"{rung.knob} already {'on' if settings[rung.knob] else 'off'}")
        else:
            parts.append(f"{rung.knob} at {settings[rung.knob]} (floor {rung.lowest:g})")
    if not parts:
        knobs = ", ".join(sorted({r.knob for r in ladder}))
        return (f"no ladder knob is in the settings (ladder knobs: {knobs}); declare them under "
                "[settings], e.g. batch_size = 64")
    return "every ladder rung is at its floor: " + ", ".join(parts)


def step_up(settings: Settings, undo: dict[str, Any]) -> Settings:
    """Climb back one rung: restore the values recorded before it (see `Step.undo`)."""
    out = dict(settings)
    out.update(undo.get("set", {}))
    for knob, ratio in undo.get("divide", {}).items():
        if _is_number(out.get(knob)) and ratio:
            out[knob] = out[knob] / ratio
    return out


def parse_ladder(raw: Any) -> tuple[Rung, ...]:
    """`[[ladder]]` tables from TOML into rungs; an empty list means "never degrade"."""
    if not isinstance(raw, list) or not all(isinstance(r, dict) for r in raw):
        raise ConfigError("ladder must be a list of [[ladder]] tables, each with knob and action")
    return tuple(Rung.from_dict(r, i) for i, r in enumerate(raw))
