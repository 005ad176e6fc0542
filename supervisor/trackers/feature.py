"""Trackers, as a feature of `rtrain launch`: every attempt gets the run's identity and the
variables W&B and MLflow read to continue one run (env.py)."""

from __future__ import annotations

from collections.abc import Mapping

from rtrain.supervisor.core import ownfiles
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.trackers import env as tracker_env


class Trackers(Feature):
    name = "trackers"

    def __init__(self, run: Run) -> None:
        self.run = run
        self._refused: str | None = None

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        identity = self.run.checkpoints.run
        try:
            mlflow_run = tracker_env.read_mlflow_run(self.run.run_dir, identity)
        except ownfiles.RefusedFile as e:
            # Something planted at the record: the attempt starts without the id (MLflow's
            # helper finds the run by its tag); the launch is not stopped for an optional file.
            mlflow_run = None
            if str(e) != self._refused:
                self._refused = str(e)
                self.run.say(f"MLflow run id not read: {e}")
        return tracker_env.variables(identity, env, mlflow_run)


def make(run: Run) -> Trackers:
    return Trackers(run)
