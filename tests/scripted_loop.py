"""The launch loop with a scripted child: a fake spawner and watcher stand in for the child
process, a fake clock and sleepers for time (as torchelastic's agent tests script monitor
results). `run` launches the real loop with them; the event log, state.json and the decisions
are the real ones, and no process starts."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from rtrain.supervisor.config import load_config
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.launch.loop import LaunchSpec, Seams, launch
from rtrain.supervisor.proc.gpu import NullReader
from rtrain.supervisor.proc.signals import SignalCatcher
from rtrain.supervisor.proc.spawn import ChildSpec
from rtrain.supervisor.proc.stop import StopResult
from rtrain.supervisor.proc.watch_outcome import Outcome
from rtrain.supervisor.records.events import read_events

PID0 = 4_200_000  # above any pid_max: no process can have it, so nothing real is touched


def crash(code: int = 1, stderr: str = "ValueError: bad batch\n") -> Observation:
    return Observation(returncode=code, stderr_tail=stderr, last_step=5)


def success() -> Observation:
    return Observation(returncode=0, last_step=10)


@dataclass
class FakeChild:
    spec: ChildSpec
    pid: int
    closed: bool = False

    def close(self) -> None:
        self.closed = True


@dataclass
class Script:
    """The spawner, watcher, clock and sleepers of one scripted launch."""

    outcomes: list[Observation]  # what the watch sees of each attempt, in order
    now: float = 1_000.0
    spawned: list[FakeChild] = field(default_factory=list)
    backoffs: list[float] = field(default_factory=list)
    sleeps: list[float] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    stop_during_backoff: int | None = None  # a signal that arrives during the backoff

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def backoff(self, seconds: float, signals: SignalCatcher) -> bool:
        self.backoffs.append(seconds)
        self.now += seconds
        if self.stop_during_backoff is not None:
            signals.pending.append(self.stop_during_backoff)
            return True
        return False

    def spawn(self, spec: ChildSpec) -> FakeChild:
        spec.attempt_dir.mkdir(parents=True, exist_ok=True)  # as the real spawn makes it
        child = FakeChild(spec, PID0 + len(self.spawned))
        self.spawned.append(child)
        return child

    def watch(self, child: FakeChild, config, **kw) -> Outcome:
        # the watcher names the child it watched
        seen = replace(self.outcomes[len(self.spawned) - 1], pid=child.pid)
        self.now += 30.0  # the attempt ran for 30 s
        return Outcome(seen=seen, stop=StopResult(returncode=seen.returncode, signal_sent=None,
                                                  killed_after_grace=False),
                       pids_seen=[child.pid])

    def seams(self, gpu=None) -> Seams:
        return Seams(gpu=gpu or NullReader(), rand=lambda: 0.0, wall=self.clock,
                     monotonic=self.clock, sleep=self.sleep, backoff=self.backoff,
                     spawn=self.spawn, watch=self.watch, say=self.said.append)


def run(tmp_path: Path, script: Script, gpu=None, *, fresh: bool = False, retry: bool = False,
        **cfg) -> tuple[int, list[dict]]:
    """`rtrain launch [--fresh] [--retry]` of the scripted child with config keys `cfg`: the exit
    code and the run's events so far."""
    config = load_config({"run_dir": tmp_path / "run", **cfg}, None, tmp_path)
    spec = LaunchSpec(command=["train.py", "--attempt", "{attempt}"], config=config,
                      echo=False, cwd=tmp_path, fresh=fresh, retry=retry)
    code = launch(spec, script.seams(gpu))
    return code, read_events(tmp_path / "run" / "events.jsonl")
