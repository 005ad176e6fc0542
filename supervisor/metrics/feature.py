"""Metrics, as a feature of `rtrain launch`: the Prometheus text file `metrics_file` names
(file.py), its counters continued from the run's events so far."""

from __future__ import annotations

from typing import Any

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.launch.feature import Feature, Run
from rtrain.supervisor.metrics.file import MetricsFile
from rtrain.supervisor.proc.watch import Sample
from rtrain.supervisor.records.events import EventLogError, read_events


class Metrics(Feature):
    name = "metrics"

    def __init__(self, run: Run) -> None:
        self.file = MetricsFile(run.config.metrics_file, run_dir=run.run_dir,
                                ckpt_dir=run.ckpt_dir, wall=run.seams.wall)
        try:
            for event in read_events(run.run_dir / "events.jsonl"):  # the run's counters
                self.file.seed(event)
        except EventLogError:  # an unreadable log: count from this launch on (loop.py says)
            pass

    def event(self, event: dict[str, Any]) -> None:
        self.file(event)

    def sample(self, sample: Sample) -> None:
        self.file.tick()  # ages

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        self.file.heartbeat(hb.step)

    def close(self) -> None:
        self.file.stopped()


def make(run: Run) -> Metrics | None:
    return Metrics(run) if run.config.metrics_file else None
