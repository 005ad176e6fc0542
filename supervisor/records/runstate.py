"""`state.json`: the supervisor's persistent state, so a restarted or requeued rtrain continues
where the last one stopped (attempt number, rung, budgets spent).

Schema v1: {"v": 1, "status": "running"|"finished"|"gave_up"|"preempted", "command": [...],
"cwd": "...", "created": unix, "updated": unix, "reason": "...", "history": History.to_dict()}.
Written atomically: temp file, fsync, os.replace, fsync of the directory, so a kill at any
moment leaves either the old state or the new one, never a torn file.

Read back as what anyone who can write the run dir may have put there: through
`ownfiles.read_own` (no link, no FIFO, at most `MAX_BYTES`), parsed with bounded nesting, and
every field checked against its type (`History`'s annotations, and the shapes of its streak,
quarantine and undo records) before any of it is used, so a wrong value is one line
(`StateError`, exit 2) before an attempt starts, not a traceback after it.
"""

from __future__ import annotations

import enum
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint.safeio import MAX_DEPTH, nested_deeper
from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.core.atomic_write import write_json_atomic
from rtrain.supervisor.core.errors import ExitCode, RtrainError
from rtrain.supervisor.core.filemode import DEFAULT_FILE_MODE
from rtrain.supervisor.decide.policy import History

STATE_VERSION = 1
STATE_FILE = "state.json"
MAX_BYTES = 64 << 20  # far more than any run's bookkeeping


class StateError(RtrainError):
    """state.json cannot be read or was written by an rtrain this one does not understand."""

    exit_code = ExitCode.USAGE


class RunStatus(str, enum.Enum):
    """running -> finished | gave_up | preempted; preempted -> running on the next launch."""

    RUNNING = "running"
    FINISHED = "finished"
    GAVE_UP = "gave_up"
    PREEMPTED = "preempted"


@dataclass(kw_only=True)
class RunState:
    """What state.json holds."""

    command: list[str]
    """The supervised command line, as given: the run's identity."""
    cwd: str = ""
    """Directory the command runs in."""
    status: RunStatus = RunStatus.RUNNING
    """Where the run stands; a finished run is not relaunched without --fresh."""
    reason: str = ""
    """The last decision's sentence (why it finished, gave up or stopped)."""
    created: float = 0.0
    """Unix time of the first launch."""
    updated: float = 0.0
    """Unix time of this write."""
    history: History = field(default_factory=History)
    """Attempts, budgets, rung: see policy.History."""

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)

    def to_dict(self) -> dict[str, Any]:
        return {"v": STATE_VERSION, "status": self.status.value, "command": list(self.command),
                "cwd": self.cwd, "reason": self.reason, "created": self.created,
                "updated": self.updated, "history": self.history.to_dict()}


def state_path(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_FILE


def save_state(run_dir: Path, state: RunState, *, mode: int = DEFAULT_FILE_MODE) -> None:
    """Replace state.json atomically (see the module docstring), with the run's file mode."""
    write_json_atomic(state_path(run_dir), state.to_dict(), mode=mode)


def load_state(run_dir: Path) -> RunState | None:
    """The saved state, or None for a run never launched. StateError for a file that cannot be
    read, an unknown version or a field of the wrong type; RefusedFile for a link or a file
    that is not a regular one."""
    path = state_path(run_dir)
    try:
        raw = _parse(ownfiles.read_own(path, limit=MAX_BYTES, what="state.json"))
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise StateError(f"{path}: {err}; move it aside to start over") from None
    if not isinstance(raw, dict) or raw.get("v") != STATE_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise StateError(f"{path}: state version {_short(version)} is not {STATE_VERSION}; it "
                         "was written by another rtrain version: use that one, or move the "
                         "file aside to start the run's bookkeeping over")
    try:
        body = {k: v for k, v in raw.items() if k != "v"}
        check_fields(body, _STATE_TYPES, "")
        history = body.get("history", {})
        check_fields(history, _HISTORY_TYPES, "history.")
        for name, (shape, required) in _SHAPES.items():
            value = history.get(name)
            records = [("", value)] if name == "streak" and value is not None else (
                [(f"[{i}]", r) for i, r in enumerate(value or ())] if name != "streak" else [])
            for at, record in records:
                check_fields(record, shape, f"history.{name}{at}.", required=required)
        body["history"] = History.from_dict(history)
        return RunState(**body)
    except (TypeError, ValueError) as err:
        raise StateError(f"{path}: unexpected content ({err}); move it aside to start "
                         "over") from None


def _parse(raw: bytes) -> Any:
    """JSON with bounded nesting. NaN and Infinity parse: an rtrain that accepted
    `--set batch_size=1e400` wrote them into `settings`, and such a run still reads (status,
    report); the typed fields below must be finite."""
    if nested_deeper(raw, MAX_DEPTH):
        raise ValueError(f"is nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # ints past int_max_str_digits included
        raise ValueError(f"not valid JSON ({err})") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ------------------------------------------------------------------ field types

_STATE_TYPES: dict[str, Any] = dict(typing.get_type_hints(RunState))
_STATE_TYPES["status"] = str  # RunStatus(...) names a wrong value itself
_STATE_TYPES["history"] = dict[str, Any]
_HISTORY_TYPES: dict[str, Any] = typing.get_type_hints(History)
_STEP = int | None
# The records inside History, as the code that writes them does (decide/streak.py,
# decide/ladder.py), and the fields the code that reads them cannot do without.
_SHAPES: dict[str, tuple[dict[str, Any], frozenset[str]]] = {
    "streak": ({"path": str, "id": str, "step": _STEP, "kind": str, "last_step": _STEP,
                "count": int}, frozenset()),
    "quarantined": ({"path": str, "id": str, "step": _STEP, "reason": str},
                    frozenset({"path", "id", "reason"})),
    "undo": ({"set": dict[str, Any], "divide": dict[str, float], "description": str},
             frozenset({"description"})),
}


def check_fields(obj: Any, types_: dict[str, Any], prefix: str, *,
                 required: frozenset[str] = frozenset()) -> None:
    """TypeError naming the first field of `obj` (a dict) that is not of its type in `types_`
    (unknown fields are left to the dataclass, which names them), or one of `required` that
    is missing."""
    if not isinstance(obj, dict):
        raise TypeError(f"{prefix.rstrip('.') or 'the state'} is {_kind(obj)}, not an object")
    for name, tp in types_.items():
        if name not in obj:
            if name in required:
                raise TypeError(f"{prefix}{name} is missing")
            continue
        value = obj[name]
        if not _fits(value, tp):
            shown = "" if value is None else f" {_short(value)}"
            raise TypeError(f"{prefix}{name} is {_kind(value)}{shown}, not {_type_name(tp)}")


def _fits(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    if tp is type(None) or tp is None:
        return value is None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, t) for t in typing.get_args(tp))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:  # within int64: a count or step rtrain could have written
        return (isinstance(value, int) and not isinstance(value, bool)
                and -(1 << 63) <= value < 1 << 63)
    if tp is float:
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    if tp is str:
        return isinstance(value, str)
    if origin is dict:
        key_t, value_t = typing.get_args(tp)
        return isinstance(value, dict) and all(_fits(k, key_t) and _fits(v, value_t)
                                               for k, v in value.items())
    if origin in (tuple, list):
        args = typing.get_args(tp)
        item_t = args[0] if args else Any
        return isinstance(value, list) and all(_fits(v, item_t) for v in value)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a type this checker does not know: the dataclass has the last word


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value), "a value")


_NAMES = {bool: ("a boolean", "booleans"), int: ("an integer", "integers"),
          float: ("a finite number", "finite numbers"), str: ("a string", "strings"),
          type(None): ("null", "nulls")}


def _type_name(tp: Any, plural: bool = False) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(t, plural) for t in typing.get_args(tp))
    if origin is dict:
        value_t = typing.get_args(tp)[1]
        what = "objects" if plural else "an object"
        return what if value_t is Any else f"{what} of {_type_name(value_t, True)}"
    if origin in (tuple, list):
        args = typing.get_args(tp)
        what = "lists" if plural else "a list"
        return what if not args or args[0] is Any else f"{what} of {_type_name(args[0], True)}"
    if tp is Any:
        return "values" if plural else "a value"
    names = _NAMES.get(tp)
    return names[plural] if names else getattr(tp, "__name__", str(tp))
