"""`state.json`: the supervisor's persistent state, so a restarted or requeued rtrain continues
where the last one stopped (attempt number, rung, budgets spent).

Schema v1: {"v": 1, "status": "running"|"finished"|"gave_up"|"preempted", "command": [...],
"cwd": "...", "created": unix, "updated": unix, "reason": "...", "history": History.to_dict()}.
Written atomically: temp file, fsync, os.replace, fsync of the directory, so a kill at any
moment leaves either the old state or the new one, never a torn file.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.decide.policy import History
from supervisor.errors import RtrainError
from supervisor.filemode import DEFAULT_FILE_MODE
from supervisor.fsio import write_json_atomic

STATE_VERSION = 1
STATE_FILE = "state.json"


class StateError(RtrainError):
    """state.json cannot be read or was written by an rtrain this one does not understand."""


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
    """The saved state, or None for a run never launched. Unknown versions raise StateError."""
    path = state_path(run_dir)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as err:
        raise StateError(f"{path}: not valid JSON ({err}); move it aside to start over") from None
    if not isinstance(raw, dict) or raw.get("v") != STATE_VERSION:
        version = raw.get("v") if isinstance(raw, dict) else None
        raise StateError(f"{path}: state version {version!r} is not {STATE_VERSION}; it was "
                         "written by another rtrain version: use that one, or move the file "
                         "aside to start the run's bookkeeping over")
    try:
        body = {k: v for k, v in raw.items() if k != "v"}
        body["history"] = History.from_dict(body.get("history", {}))
        return RunState(**body)
    except (TypeError, ValueError) as err:
        raise StateError(f"{path}: unexpected content ({err}); move it aside to start "
                         "over") from None
