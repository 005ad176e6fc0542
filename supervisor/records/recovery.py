"""The cost of each failure: the time from the failure to the relaunched attempt's first step,
cut into phases, and the steps the relaunch runs again.

The phases follow one another, each from the end of the one before (all unix times; the worker
and the supervisor read the same host clock):

    failed ─teardown─ exited ─detection─ classified ─decision, backoff─ spawning
      ─spawn─ script running ─imports─ restore begins ─restore─ restored ─first_step─ first step

- failed: a hang declared by the watch, else the failure as a rank reported it by its own
  clock (`exit.reported_at`: its `exception` heartbeat or exit record), else the exit;
  `teardown` (the failing process's way out: a save at the failure and the interpreter's
  shutdown, or the stack dump and stop of a hung one) is unknown without either;
- exited: the watch saw the process end (`exit.exited_at`); classified: the `classification`;
- spawning: the supervisor starts the next child (`launch.spawn_at`); in between, the decision,
  state.json, the checkpoint pick and the GPU release wait (`decision`) and the backoff the
  policy chose (`backoff`, its own column: a choice, not overhead);
- script running: the later of the process's exec (`launch.spawn_at` + `spawn_s`) and the
  worker's `started` (the process's start, to the clock tick, or `runtime.mark_script_start`
  where an interpreter started earlier runs the script); else the `launch` event;
- restore begins / restored: the `restore_s` heartbeat `Checkpointer.restore` sends; without
  one, `imports` ends at the worker's first heartbeat and `restore` is unknown;
- first step: rank 0's first `step` heartbeat.

An unknown phase's time goes to the next known one, so the phases known always add up to
`total_s`. A relaunched attempt that ends before its first step ends its recovery there
(`complete` false); one that sent no heartbeat at all (a script without the worker library)
gives nothing to measure and records none.

Work lost: the failed attempt's last step minus the step the relaunch resumed from (the
restore's, else the launch's checkpoint), times the run's step time (the mean interval between
step heartbeats of the latest attempt that had two). `lost_s` = `total_s` + that.

`RecoveryTracker` follows the events (an EventLog listener) and rank 0's heartbeats and holds
the finished records for the caller to emit (`take`): listeners never emit. `breakdown` and
`costs_by_kind` are pure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtrain.checkpoint.layout import parse_step
from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.core.protocol import Heartbeat

Event = dict[str, Any]

PHASES = ("teardown", "detection", "decision", "backoff", "spawn", "imports", "restore",
          "first_step")
"""In order; each is a `<phase>_s` field of the `recovery` event."""


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@dataclass(kw_only=True)
class Marks:
    """The moments of one failure and its relaunch (unix times; None: not seen)."""

    failure: str
    failed_attempt: int
    last_step: int | None = None
    """The failed attempt's newest step (its `exit`)."""
    reported_at: float | None = None
    hang_at: float | None = None
    exited_at: float | None = None
    classified_at: float | None = None
    backoff_s: float = 0.0
    """The backoff the decision chose."""
    attempt: int | None = None
    """The relaunched attempt."""
    spawn_at: float | None = None
    spawn_s: float | None = None
    """The supervisor's spawn call, up to the exec (or the hand-over to a waiting process)."""
    launched_at: float | None = None
    resume_step: int | None = None
    """The step of the checkpoint the launch named (0: fresh; None: a name without a step)."""
    started_at: float | None = None
    first_report_at: float | None = None
    restored_at: float | None = None
    restore_s: float | None = None
    restored_step: int | None = None
    first_step_at: float | None = None
    ended_at: float | None = None
    """The relaunched attempt failed or ended before its first step."""
    step_time_s: float | None = None

    def failed_at(self) -> float | None:
        if self.hang_at is not None:
            return self.hang_at
        if self.reported_at is not None and (self.exited_at is None
                                             or self.reported_at <= self.exited_at):
            return self.reported_at
        return self.exited_at


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def breakdown(m: Marks) -> Event:
    """The `recovery` event's fields for `m`: the phases (module docstring), the steps and the
    seconds lost."""
    start = m.failed_at()
    # The script runs once the process is exec'd (the supervisor's spawn returned) and the
    # worker says it started (a process's start is known to the clock tick only; an
    # interpreter started ahead marks its hand-over itself): the later of the two.
    spawned = (m.spawn_at + m.spawn_s if m.spawn_at is not None and m.spawn_s is not None
               else m.spawn_at if m.started_at is not None else m.launched_at)
    running = max((t for t in (spawned, m.started_at) if t is not None), default=None)
    restore_begins = (None if m.restored_at is None or m.restore_s is None
                      else m.restored_at - m.restore_s)
    # Each phase ends at a moment; None: not seen, its time goes to the next phase seen.
    ends = {"teardown": None if start == m.exited_at else m.exited_at,
            "detection": m.classified_at, "wait": m.spawn_at, "spawn": running,
            "imports": restore_begins if restore_begins is not None else m.first_report_at,
            "restore": m.restored_at if restore_begins is not None else None,
            "first_step": m.first_step_at}
    phases: dict[str, float | None] = {}
    prev = start
    for name, end in ends.items():
        if prev is None or end is None:
            phases[name] = None
            continue
        end = max(prev, end)  # clocks read in two processes: never a negative phase
        phases[name], prev = end - prev, end
    wait = phases.pop("wait")
    backoff = None if wait is None else min(max(m.backoff_s, 0.0), wait)
    phases["decision"] = None if wait is None or backoff is None else wait - backoff
    phases["backoff"] = backoff
    complete = m.first_step_at is not None
    end = m.first_step_at if complete else m.ended_at
    total = None if start is None or end is None else max(end, prev or end) - start
    resumed = m.restored_step if m.restored_step is not None else m.resume_step
    steps = (max(0, m.last_step - resumed) if m.last_step is not None and resumed is not None
             else None)
    work = steps * m.step_time_s if steps is not None and m.step_time_s is not None else None
    lost = None if total is None else total + (work or 0.0)
    return {"attempt": m.attempt, "failed_attempt": m.failed_attempt, "failure": m.failure,
            "complete": complete, **{f"{p}_s": _r(phases[p]) for p in PHASES},
            "total_s": _r(total), "last_step": m.last_step, "resumed_step": resumed,
            "steps_lost": steps, "step_time_s": _r(m.step_time_s), "work_lost_s": _r(work),
            "lost_s": _r(lost)}


@dataclass
class _Steps:
    first: tuple[int, float] | None = None
    last: tuple[int, float] | None = None

    def add(self, step: int, at: float) -> None:
        self.first = self.first or (step, at)
        self.last = (step, at)

    def mean_s(self) -> float | None:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return None
        return (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])


def _resume_step(path: Any) -> int | None:
    if not isinstance(path, str) or not path:
        return 0  # a fresh start
    return parse_step(Path(path).name)


@dataclass
class RecoveryTracker:
    """One launch's failures and relaunches, as they happen (module docstring)."""

    _exit: Event | None = None
    _classified: Marks | None = None  # waiting for its decision
    _pending: Marks | None = None  # relaunched, waiting for its first step
    _steps: dict[int, _Steps] = field(default_factory=dict)
    _step_time: float | None = None
    _ready: list[Event] = field(default_factory=list)

    def __call__(self, event: Event) -> None:
        """An EventLog listener: exit, classification, decision and launch move it on."""
        kind, attempt = event.get("kind"), _int(event.get("attempt"))
        p = self._pending
        if kind == Kind.EXIT:
            self._exit = event
            steps = self._steps.pop(attempt, None) if attempt is not None else None
            mean = steps.mean_s() if steps is not None else None
            self._step_time = mean if mean is not None else self._step_time
            if p is not None and p.attempt is not None and p.attempt == attempt:
                self._pending = None
                if p.first_report_at is not None:
                    # It ended before its first step: the cost up to this ending. (Without a
                    # heartbeat at all the script does not report steps: nothing to measure.)
                    ended = self._marks_of_exit(Marks(failure="", failed_attempt=-1), event)
                    p.ended_at = ended.failed_at() or _num(event.get("time"))
                    self._ready.append(breakdown(p))
        elif kind == Kind.CLASSIFICATION and self._exit is not None \
                and _int(self._exit.get("attempt")) == attempt and attempt is not None:
            m = Marks(failure=str(event.get("failure") or "unnamed"), failed_attempt=attempt,
                      last_step=_int(self._exit.get("last_step")),
                      classified_at=_num(event.get("time")), step_time_s=self._step_time)
            self._classified = self._marks_of_exit(m, self._exit)
        elif kind == Kind.DECISION:
            c, self._classified = self._classified, None
            if c is not None and c.failed_attempt == attempt and event.get("action") == "relaunch":
                c.backoff_s = _num(event.get("backoff_s")) or 0.0
                self._pending = c
        elif kind == Kind.LAUNCH and p is not None and p.attempt is None \
                and attempt is not None and attempt != p.failed_attempt:
            p.attempt, p.spawn_at = attempt, _num(event.get("spawn_at"))
            p.spawn_s = _num(event.get("spawn_s"))
            p.launched_at = _num(event.get("time"))
            p.resume_step = _resume_step(event.get("resume_from"))

    @staticmethod
    def _marks_of_exit(m: Marks, exit_event: Event) -> Marks:
        m.reported_at = _num(exit_event.get("reported_at"))
        m.hang_at = _num(exit_event.get("hang_at"))
        m.exited_at = _num(exit_event.get("exited_at"))
        return m

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        """One heartbeat of `attempt`; only rank 0's count (ranks start and step together)."""
        at = _num(hb.time)
        if hb.rank != 0 or at is None:
            return
        if hb.event == "step" and _int(hb.step) is not None:
            self._steps.setdefault(attempt, _Steps()).add(hb.step, at)  # type: ignore[arg-type]
        p = self._pending
        if p is None or p.attempt != attempt:
            return
        if p.first_report_at is None:
            p.first_report_at = at
        if _num(hb.started) is not None and p.started_at is None:
            p.started_at = _num(hb.started)
        if _num(hb.restore_s) is not None:
            p.restored_at, p.restore_s = at, _num(hb.restore_s)
            p.restored_step = _int(hb.step) if hb.step is not None else 0
        if hb.event == "step" and hb.step is not None:
            p.first_step_at = at
            self._ready.append(breakdown(p))
            self._pending = None

    def take(self) -> list[Event]:
        """The recovery records finished since the last call, oldest first."""
        ready, self._ready = self._ready, []
        return ready


@dataclass(frozen=True, kw_only=True)
class KindCost:
    """The failures of one kind: how many, and what their recoveries cost."""

    kind: str
    count: int
    phases: dict[str, tuple[float, float] | None]
    """Per phase (and `total`): (sum, mean) over the recoveries that measured it; None: none."""
    steps_lost: int
    lost_s: float


def costs_by_kind(recoveries: Iterable[Event]) -> list[KindCost]:
    """`recovery` events folded per failure kind, the costliest (`lost_s`) first."""
    groups: dict[str, list[Event]] = {}
    for r in recoveries:
        groups.setdefault(str(r.get("failure") or "unnamed"), []).append(r)
    out = []
    for kind, rs in groups.items():
        phases: dict[str, tuple[float, float] | None] = {}
        for p in (*PHASES, "total"):
            seen = [v for r in rs if (v := _num(r.get(f"{p}_s"))) is not None]
            phases[p] = (sum(seen), sum(seen) / len(seen)) if seen else None
        out.append(KindCost(kind=kind, count=len(rs), phases=phases,
                            steps_lost=sum(_int(r.get("steps_lost")) or 0 for r in rs),
                            lost_s=sum(_num(r.get("lost_s")) or 0.0 for r in rs)))
    return sorted(out, key=lambda c: (-c.lost_s, c.kind))


def seconds(value: float | None) -> str:
    """A phase's length for a person: "3 ms", "0.41 s", "2m05s"; "-" when not measured."""
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.3g} s"
    s = round(value)
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def describe(r: Event) -> str:
    """One line: what the failure cost, phase by phase (the measured ones)."""
    head = (f"{r.get('failure')} of attempt {r.get('failed_attempt')}: "
            + (f"{seconds(_num(r.get('total_s')))} to the first step of attempt "
               f"{r.get('attempt')}" if r.get("complete") else
               f"attempt {r.get('attempt')} ended {seconds(_num(r.get('total_s')))} later, "
               "before a step"))
    parts = [f"{p.replace('_', ' ')} {seconds(v)}" for p in PHASES
             if (v := _num(r.get(f"{p}_s"))) is not None]
    text = head + (f" ({', '.join(parts)})" if parts else "")
    steps = _int(r.get("steps_lost"))
    if steps is not None:
        work = _num(r.get("work_lost_s"))
        text += f"; {steps:,} steps run again" + (f" ({seconds(work)})" if work else "")
    return text
