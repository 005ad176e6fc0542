"""Trackers, as a feature of `rtrain launch`: every attempt gets the run's identity and the
variables W&B and MLflow read to continue one run (env.py)."""

from __future__ import annotations

from collections.abc import Mapping

from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.trackers import env as tracker_env


class Trackers(Feature):
    name = "trackers"

    def __init__(self, run: Run) -> None:
        self.run = run

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        identity = self.run.checkpoints.run
        return tracker_env.variables(
            identity, env, tracker_env.read_mlflow_run(self.run.run_dir, identity))


def make(run: Run) -> Trackers:
    return Trackers(run)
