"""`rtrain report`: gather a run's history from its files into plain data (rendering:
`report_html.py`).

Reads what `rtrain status` reads (events.jsonl, state.json, the checkpoint dir's manifests) and
writes nothing but the report; safe beside a live supervisor. Sources:

- curves: `heartbeat_summary` events (step, loss, samples/s), one series per attempt, so a
  resumed attempt that replays steps shows as its own line;
- failures: `classification` events, placed at the attempt's last step (its `exit` event);
- degradations: `degrade` events, at the step of the failure that caused them;
- checkpoints: committed `checkpoint-<step>` dirs now on disk (step and the manifest's commit
  time), plus `skipped_checkpoint` events and dirs whose manifest does not load (bad ones);
- attempts: `launch` / `exit` / `classification` / `decision` events per attempt number, and
  at a hang its `stuck_ranks` event (which rank is behind, where each rank is);
- time lost to failures: `recovery` events per failure kind (count, each phase's total and
  mean, steps run again, seconds lost);
- stragglers: `straggler` events (a rank slower than the others, and its node);
- saves: the count of `save_skipped` events, the newest checkpoint's age, and the warning of
  a run that ended with its final state unsaved (`final_state_unsaved`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.layout import list_checkpoints, parse_step
from rtrain.supervisor.commands.status import finite, json_safe, summarize
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.records.recovery import KindCost, costs_by_kind
from rtrain.supervisor.records.timeline import AttemptRecord, failure_kind, read_timeline


@dataclass(frozen=True, kw_only=True)
class Point:
    attempt: int
    step: int
    time: float
    loss: float | None
    samples_per_s: float | None


@dataclass(frozen=True, kw_only=True)
class Marker:
    kind: str
    """failure, degrade, checkpoint or bad_checkpoint."""
    step: int | None
    time: float | None
    attempt: int | None = None
    label: str = ""
    """The failure kind for failures; the checkpoint's name for checkpoints."""
    detail: str = ""
    """The sentence a person reads (reason, change)."""


@dataclass(kw_only=True)
class AttemptRow:
    attempt: int
    start: float
    duration_s: float | None = None
    resume_from: str | None = None
    """Name of the checkpoint it resumed from; None for a fresh start."""
    tier: str | None = None
    """Where that checkpoint was read from: "memory" (the memory tier's snapshot) or "disk"."""
    settings: dict[str, Any] = field(default_factory=dict)
    level: int = 0
    returncode: int | None = None
    signal: str | None = None
    last_step: int | None = None
    outcome: str = "running"
    """The failure kind, or finished / stopped / running / unknown."""
    reason: str = ""
    decision: str = ""
    stuck: str = ""
    """At a hang: which rank is behind and where the ranks are (the `stuck_ranks` summary)."""
    behind: list[int] = field(default_factory=list)
    """At a hang: the ranks the others waited for."""


@dataclass(kw_only=True)
class Report:
    run_dir: Path
    ckpt_dir: Path
    status: str
    reason: str
    generated: float
    points: list[Point] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    attempts: list[AttemptRow] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    skipped_saves: int = 0
    """Saves the worker skipped (`save_skipped` events: full disk, storage errors)."""
    checkpoint_age_s: float | None = None
    """Age of the newest checkpoint that verifies quick, when the report was made."""
    warning: str = ""
    """Why the run's final state is in no checkpoint, when its last ending said so."""
    mirror: dict[str, Any] | None = None
    """With a mirror: what `rtrain status` says of it (uploaded step, lag, final upload)."""
    failure_costs: list[KindCost] = field(default_factory=list)
    """Time lost to failures, per kind: the `recovery` events folded (records/recovery.py)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Ranks found slower than the others (`straggler` events): attempt, step, rank, host,
    ratio, detail."""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["run_dir"], out["ckpt_dir"] = str(self.run_dir), str(self.ckpt_dir)
        return json_safe(out)


def _number(value: Any) -> float | None:
    return float(value) if finite(value) else None


def _int(value: Any) -> int:
    return int(value) if finite(value) else 0


def _name(path: Any) -> str | None:
    return Path(path).name if isinstance(path, str) and path else None


def _resumed_step(row: AttemptRow) -> int | None:
    return parse_step(row.resume_from or "")


def _row(a: AttemptRecord) -> AttemptRow:
    """One attempt's row: its launch, exit, classification and decision."""
    launch = a.launch
    row = AttemptRow(attempt=a.number, start=launch["time"],
                     resume_from=_name(launch.get("resume_from")),
                     tier=launch.get("tier") if launch.get("tier") in ("memory", "disk")
                     else None,
                     settings=dict(launch.get("settings") or {}), level=_int(launch.get("level")))
    row.last_step = a.last_step if a.last_step is not None else _resumed_step(row)
    if a.exit is not None:
        row.duration_s = _number(a.exit.get("duration_s"))
        row.returncode, row.signal = a.exit.get("returncode"), a.exit.get("signal")
        row.outcome = "unknown"
    if a.classification is not None:
        row.outcome = failure_kind(a.classification)
        row.reason = str(a.classification.get("reason") or "")
    if a.stuck is not None:
        row.stuck = str(a.stuck.get("summary") or "")
        row.behind = [r for r in a.stuck.get("behind") or [] if isinstance(r, int)]
    if a.decision is not None:
        action = str(a.decision.get("action") or "")
        row.decision = f"{action}: {a.decision.get('reason', '')}".strip(": ")
        if action == "finished":
            row.outcome = "finished"
        elif row.outcome == "unknown" and action in ("exit_preempted", "requeue"):
            row.outcome = "stopped"
    return row


def gather(run_dir: Path, *, key: bytes | None = None, now: float | None = None) -> Report:
    """Everything the report shows, from the run's files. UsageError when RUN_DIR holds no run."""
    run_dir = Path(run_dir)
    timeline = read_timeline(run_dir / "events.jsonl", keep_curve=True)
    summary = summarize(run_dir, key=key, now=now, timeline=timeline)
    rep = Report(run_dir=run_dir, ckpt_dir=summary.ckpt_dir, status=summary.status,
                 reason=summary.reason, generated=time.time() if now is None else now,
                 failures=dict(summary.failures), skipped_saves=summary.skipped_saves,
                 checkpoint_age_s=summary.checkpoint_age_s, warning=summary.unsaved or "",
                 mirror=summary.mirror)
    rep.failure_costs = costs_by_kind(timeline.recoveries)
    rep.stragglers = [{k: e.get(k) for k in ("attempt", "step", "rank", "host", "ratio",
                                             "detail")} for e in timeline.stragglers]
    rows = {n: _row(a) for n, a in timeline.attempts.items()}
    for e in timeline.points:
        attempt = e.get("attempt")
        if isinstance(e.get("step"), int):
            rep.points.append(Point(attempt=attempt if isinstance(attempt, int) else -1,
                                    step=e["step"], time=e["time"], loss=_number(e.get("loss")),
                                    samples_per_s=_number(e.get("samples_per_s"))))
    for note in timeline.notes:
        e, row = note.event, rows.get(note.attempt) if note.attempt is not None else None
        # Before any step of its own an attempt stands at the step it resumed from.
        step = note.step if note.step is not None or row is None else _resumed_step(row)
        if e["kind"] == Kind.CLASSIFICATION and row is not None:
            rep.markers.append(Marker(kind="failure", step=step, time=e["time"],
                                      attempt=row.attempt, label=failure_kind(e),
                                      detail=str(e.get("reason") or "")))
        elif e["kind"] == Kind.DEGRADE:
            rep.markers.append(Marker(kind="degrade", step=step, time=e["time"],
                                      attempt=e.get("attempt"), label=f"rung {e.get('level')}",
                                      detail=str(e.get("change") or "")))
        elif e["kind"] == Kind.SKIPPED_CHECKPOINT:
            name = _name(e.get("path")) or "?"
            rep.markers.append(Marker(kind="bad_checkpoint", step=parse_step(name),
                                      time=e["time"], attempt=note.attempt, label=name,
                                      detail=str(e.get("reason") or "")))
    if summary.status != "running":
        for row in rows.values():
            if row.outcome == "running":
                row.outcome = "unknown"  # no exit recorded: the supervisor was killed
    rep.attempts = [rows[n] for n in sorted(rows)]
    rep.markers += _checkpoints(rep.ckpt_dir, {m.label for m in rep.markers
                                               if m.kind == "bad_checkpoint"})
    return rep


def _checkpoints(ckpt_dir: Path, already_bad: set[str]) -> list[Marker]:
    out = []
    for step, path in sorted(list_checkpoints(ckpt_dir)):
        try:
            created = mf.load(path)["created"]
        except mf.ManifestError as err:
            if path.name not in already_bad:
                out.append(Marker(kind="bad_checkpoint", step=step, time=None, label=path.name,
                                  detail=str(err)))
            continue
        out.append(Marker(kind="checkpoint", step=step, time=float(created), label=path.name))
    return out
