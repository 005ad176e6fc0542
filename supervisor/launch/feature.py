"""The protocol between the supervision loop and its optional features.

The loop (loop.py) runs attempts: pick a checkpoint, spawn, watch, judge, record, act. What it
can do without is a feature: one folder with a `feature.py` whose `make(run)` returns a
`Feature` (or None, when the run's config leaves it off), listed on one line in
supervisor/features.py. The loop imports none of them; it calls the features it was handed, in
their order, at these moments of a launch:

    start            the run goes on (it had not ended); may stop the launch (UsageError)
    attempt_start    an attempt is about to start from `attempt.chosen`
    environment      the attempt's environment is built: variables to add
    spawn            the first feature that answers starts the child (the warm standby)
    sample, heartbeat, pressure, event    while the child runs (each event once it is written)
    hang             the watch found the child hung, before it is stopped
    attempt_end      the child is gone: what the feature found of it, for the observation
    run_end          no relaunch follows: the run finished, gave up or stops
    close            the launch ends, in every case

Every method does nothing by default: a feature writes only the moments it uses. A feature
never decides what happens to the run; the judge (decide/attempt.py) does, from the
observation, to which `attempt_end` may add (the stuck ranks at a hang).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rtrain.checkpoint.verify import Verdict
    from rtrain.supervisor.config import Config
    from rtrain.supervisor.core.protocol import Heartbeat
    from rtrain.supervisor.decide.observation import Observation
    from rtrain.supervisor.decide.policy import Decision
    from rtrain.supervisor.launch.resume import Checkpoints
    from rtrain.supervisor.launch.spec import Seams
    from rtrain.supervisor.pressure.monitor import PressureNote
    from rtrain.supervisor.proc.gpu import GpuReader
    from rtrain.supervisor.proc.spawn import Child, ChildSpec
    from rtrain.supervisor.proc.watch import Sample
    from rtrain.supervisor.records.events import EventLog


@dataclass(frozen=True, kw_only=True)
class Run:
    """What a feature is made from: one launch's parts."""

    config: Config
    command: list[str]  # the child's argv, templates not filled in
    resume_args: tuple[str, ...]
    cwd: Path
    run_dir: Path
    ckpt_dir: Path
    events: EventLog
    say: Callable[[str], None]
    checkpoints: Checkpoints
    seams: Seams
    gpu: GpuReader
    echo: bool  # the child's output is teed to our terminal


@dataclass(kw_only=True)
class Attempt:
    """One attempt as the features see it. `attempt_start` may set `read_from` (the chosen
    checkpoint, read from elsewhere: the memory tier) and add `notes` for the launch line."""

    number: int
    chosen: Verdict | None  # the checkpoint it resumes from; None: a fresh start
    newest_allowed: bool  # the group may resume from parts newer than `chosen`
    attempt_dir: Path
    read_from: Path | None = None
    notes: list[str] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=dict)  # set once the environment is built
    tier: str | None = None  # where the resume reads from, for the launch event


class Feature:
    """An optional part of `rtrain launch`: override the moments it uses."""

    name = "feature"

    def start(self, *, new_run: bool, starting_over: bool) -> None:
        """The run goes on. `starting_over`: `--resume never` on a new run, checkpoints set
        aside. Raise UsageError to stop the launch before any attempt."""

    def attempt_start(self, attempt: Attempt) -> None:
        """Attempt `attempt.number` is about to start."""

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        """Variables to add to the attempt's environment `env`."""
        return {}

    def spawn(self, spec: ChildSpec, attempt: Attempt,
              interrupted: Callable[[], bool]) -> tuple[Child, float] | None:
        """Start the child instead of a plain spawn: it and its start-up seconds; None: not
        this feature."""
        return None

    def sample(self, sample: Sample) -> None:
        """A watch sample of the child's tree and devices."""

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        """A heartbeat of the attempt's ranks."""

    def pressure(self, attempt: int, note: PressureNote) -> None:
        """Memory pressure: rising (nothing asked of the child yet), or a relief or a stop
        asked of it."""

    def event(self, event: dict[str, Any]) -> None:
        """An event, once it is in events.jsonl."""

    def hang(self, attempt: Attempt) -> None:
        """The watch found the child hung; its processes still run."""

    def attempt_end(self, attempt: Attempt, seen: Observation) -> Mapping[str, Any]:
        """The attempt's processes are gone: Observation fields to add (what this feature
        found of the ending), or nothing."""
        return {}

    def run_end(self, decision: Decision) -> None:
        """The run stops (no relaunch follows): finished, gave up, or stopped (a preemption,
        a requeue, a stop during the backoff)."""

    def pids(self) -> list[int]:
        """rtrain's own helper processes this feature runs (not the attempt's)."""
        return []

    def close(self) -> None:
        """The launch ends."""


Factory = Callable[[Run], "Feature | None"]


class Features:
    """The features of one launch, called in their order."""

    def __init__(self, made: Iterable[Feature]) -> None:
        self.all = list(made)

    def __iter__(self):
        return iter(self.all)

    def start(self, **kw: bool) -> None:
        for f in self.all:
            f.start(**kw)

    def attempt_start(self, attempt: Attempt) -> None:
        for f in self.all:
            f.attempt_start(attempt)

    def environment(self, attempt: Attempt, env: dict[str, str]) -> None:
        for f in self.all:
            env.update(f.environment(attempt, env))

    def spawn(self, spec: ChildSpec, attempt: Attempt,
              interrupted: Callable[[], bool]) -> tuple[Child, float] | None:
        for f in self.all:
            started = f.spawn(spec, attempt, interrupted)
            if started is not None:
                return started
        return None

    def sample(self, sample: Sample) -> None:
        for f in self.all:
            f.sample(sample)

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        for f in self.all:
            f.heartbeat(attempt, hb)

    def pressure(self, attempt: int, note: PressureNote) -> None:
        for f in self.all:
            f.pressure(attempt, note)

    def event(self, event: dict[str, Any]) -> None:
        for f in self.all:
            f.event(event)

    def hang(self, attempt: Attempt) -> None:
        for f in self.all:
            f.hang(attempt)

    def attempt_end(self, attempt: Attempt, seen: Observation) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for f in self.all:
            found.update(f.attempt_end(attempt, seen))
        return found

    def run_end(self, decision: Decision) -> None:
        for f in self.all:
            f.run_end(decision)

    def pids(self) -> list[int]:
        return [pid for f in self.all for pid in f.pids()]

    def close(self) -> None:
        for f in self.all:
            f.close()
