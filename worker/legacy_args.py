"""The Checkpointer's keyword arguments from before the option groups, translated.

In rtrain 0.1 every setting was a keyword argument of its own (31 of them). They keep working
through the next release, each with a DeprecationWarning that names its new spelling, and go in
the one after. A pure function: the Checkpointer warns and applies what it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.cadence import MAX_SECONDS, CadenceBounds
from worker.options import Every, Keep, Restoring, Saving

# old keyword -> (its group's keyword, the field in that group)
MOVED: dict[str, tuple[str, str]] = {
    "every_steps": ("every", "steps"),
    "every_seconds": ("every", "seconds"),
    "on_epoch_end": ("every", "epoch_end"),
    "total_steps": ("every", "total_steps"),
    "keep_best": ("keep", "best"),
    "metric": ("keep", "metric"),
    "mode": ("keep", "mode"),
    "milestone_every": ("keep", "milestone_every"),
    "fsync": ("saving", "fsync"),
    "sharded": ("saving", "sharded"),
    "trainable_only": ("saving", "trainable_only"),
    "save_on_failure": ("saving", "on_failure"),
    "failure_save_timeout_s": ("saving", "failure_timeout_s"),
    "async_mode": ("saving", "async_mode"),
    "verify_level": ("restoring", "verify"),
    "map_location": ("restoring", "map_location"),
    "allow_resize": ("restoring", "allow_resize"),
    "allow_pickle": ("restoring", "allow_pickle"),
}
GROUP_CLASS = {"every": Every, "keep": Keep, "saving": Saving, "restoring": Restoring}
OTHER = ("async_save", "sampler", "on_pressure")  # translated one by one below
KNOWN = frozenset(MOVED) | frozenset(OTHER)


@dataclass(frozen=True)
class Translated:
    """The new arguments, with the old ones folded in, and one warning per old one."""

    every: Any
    keep: Any
    saving: Saving | None
    restoring: Restoring | None
    sampler: Any  # a bare ResumableSampler, passed as loader= from now on
    on_pressure: Callable[[], str | None] | None
    warnings: tuple[str, ...]


def translate(old: dict[str, Any], *, every: Any, keep: Any, saving: Saving | None,
              restoring: Restoring | None) -> Translated:
    """Fold the old keyword arguments `old` into the new ones. An unknown name is a TypeError,
    as for any function; so is an old name given beside an explicit group that holds it
    (`fsync=` with `saving=`): which one was meant cannot be known."""
    unknown = sorted(set(old) - KNOWN)
    if unknown:
        raise TypeError(f"Checkpointer() got an unexpected keyword argument {unknown[0]!r}")
    given = {"every": every, "keep": keep, "saving": saving, "restoring": restoring}
    fields: dict[str, dict[str, Any]] = {g: {} for g in GROUP_CLASS}
    warnings = []
    for name, value in old.items():
        if name not in MOVED:
            continue
        group, field = MOVED[name]
        if name == "async_mode":
            continue  # with async_save, below
        fields[group][field] = value
        new = (f"{group}={GROUP_CLASS[group].__name__}({field}=...)" if name != "every_steps"
               else "every= (a number of steps, 'auto', or Every(steps=...))")
        warnings.append(f"Checkpointer({name}=) is deprecated: use {new}")
    if "async_save" in old or "async_mode" in old:
        mode = old.get("async_mode", "auto") if old.get("async_save") else "off"
        fields["saving"]["async_mode"] = mode
        said = ", ".join(f"{n}=" for n in ("async_save", "async_mode") if n in old)
        warnings.append(f"Checkpointer({said}) is deprecated: use "
                        f"saving=Saving(async_mode={mode!r})")
    steps = fields["every"].get("steps")
    if isinstance(steps, CadenceBounds):
        fields["every"].update(_auto_fields(steps, fields["every"].get("seconds")))
    if "sampler" in old:
        warnings.append("Checkpointer(sampler=) is deprecated: pass the DataLoader as loader= "
                        "(or, with no DataLoader, the ResumableSampler itself as loader=)")
    if old.get("on_pressure") is not None:
        warnings.append("Checkpointer(on_pressure=) is deprecated: call "
                        "worker.on_pressure(callback) once")
    merged = {g: _merge(g, given[g], fields[g]) for g in GROUP_CLASS}
    return Translated(merged["every"], merged["keep"], merged["saving"], merged["restoring"],
                      old.get("sampler"), old.get("on_pressure"), tuple(warnings))


def _auto_fields(bounds: CadenceBounds, seconds: float | None) -> dict[str, Any]:
    """`every_steps=CadenceBounds(...)`: an automatic cadence with those bounds; an explicit
    `every_seconds=` still sets its longest time between saves, as it did."""
    if seconds is None and bounds.max_seconds != MAX_SECONDS:
        seconds = bounds.max_seconds
    return {"steps": "auto", "min_steps": bounds.min_steps, "max_steps": bounds.max_steps,
            "seconds": seconds}


def _merge(group: str, value: Any, fields: dict[str, Any]) -> Any:
    """The group's new value with the old fields set on it."""
    if not fields:
        return value
    cls = GROUP_CLASS[group]
    if group == "keep" and (value is None or isinstance(value, int)):
        return cls(last=value, **fields)  # keep=3 stays the number kept, as it was
    if value is not None:
        raise TypeError(f"Checkpointer() got {group}= and the old "
                        f"{', '.join(_old_names(group, fields))}: set them in {group}= only")
    return cls(**fields)


def _old_names(group: str, fields: dict[str, Any]) -> list[str]:
    return [f"{old}=" for old, (g, f) in MOVED.items() if g == group and f in fields]
