"""`History`: what earlier attempts of a run spent and changed, carried in state.json.

A frozen record: `policy.decide` returns a new one and never mutates the old, and
`runstate` persists it as JSON (`to_dict` / `from_dict`). Fields added later have defaults, so a
state.json written before them still loads.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class History:
    """What earlier attempts of this run spent and changed; persisted in state.json."""

    attempt: int = 0
    """Number of the attempt to launch next (RTRAIN_ATTEMPT), continued across requeues."""
    total_restarts: int = 0
    """Relaunches charged since the run last made progress, all kinds together (preemptions
    are free; progress forgives the charges, see budgets.forgive)."""
    budgets_used: dict[str, int] = field(default_factory=dict)
    """Relaunches charged per budget name (crash, oom, hang, nonfinite, lost_device, data) since
    the run last made progress."""
    level: int = 0
    """Ladder rungs walked down (0: the configured settings)."""
    settings: dict[str, Any] | None = None
    """Knob values in force; None means config.settings."""
    undo: tuple[dict[str, Any], ...] = ()
    """One undo record per rung walked (ladder.Step.undo), newest last."""
    launch_step: int | None = None
    """Newest verified checkpoint step seen so far (the crash-loop rule's high-water mark)."""
    stalled: tuple[int | None, ...] = ()
    """Newest verified step after each consecutive attempt that did not advance it."""
    healthy_steps: int = 0
    """Training steps made since the last rung change."""
    lr_factor: float = 1.0
    """Product of the lr cuts applied after non-finite losses."""
    charge_step: int | None = None
    """Newest verified step when the last charged failure happened."""
    progress_steps: int = 0
    """Training steps made since the last charged failure."""
    progress_s: float = 0.0
    """Seconds spent in attempts that trained, since the last charged failure."""
    forgiven: int = 0
    """Charged relaunches forgiven after progress, over the run's life."""
    failure_times: tuple[float, ...] = ()
    """Unix times of the charged failures of the last hour (the rate guard)."""
    streak: dict[str, Any] | None = None
    """{"path", "id", "step", "kind", "last_step", "count"}: consecutive attempts that resumed
    from one checkpoint and failed the same way at the same step before committing a newer one
    (quarantine)."""
    quarantined: tuple[dict[str, Any], ...] = ()
    """{"path", "id", "step", "reason"} per quarantined checkpoint, oldest first."""
    bad_checkpoints: tuple[str, ...] = ()
    """Checkpoints a worker could not load (`bad_checkpoint`), as "<path>|<manifest created>":
    never offered again in this run; a checkpoint saved later at the same path is another."""
    started_over: float | None = None
    """Unix time the run started over (`--resume never`): the earlier run's checkpoints in the
    dir were set aside then (ckpt/setaside.py), and a mirror's checkpoints made before it are
    the earlier run's too, never fetched for this run."""
    rung_peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per ladder level (the level as a string): the largest memory footprint measured on it,
    {"host": process-tree RSS, "host_limit", "gpu": NVML used, "gpu_limit"} in bytes; a
    climb back needs the rung above to fit by it (pressure/decide.py)."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("undo", "stalled", "failure_times", "quarantined", "bad_checkpoints"):
            out[name] = list(getattr(self, name))
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> History:
        """Inverse of `to_dict`; unknown keys raise TypeError (the caller names the file)."""
        raw = dict(raw)
        for name in ("undo", "stalled", "failure_times", "quarantined", "bad_checkpoints"):
            raw[name] = tuple(raw.get(name, ()))
        return cls(**raw)
