"""Stuck ranks, as a feature of `rtrain launch`: the NCCL flight recorder set up for each
attempt on a GPU (flight.py) and asked for its dumps at a hang; once the hung attempt is gone,
which rank is stuck and where (collect.py), for the hang's reason and the `stuck_ranks` record."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rtrain.supervisor.core.filemode import env_mode
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.stuck import flight

log = logging.getLogger(__name__)


class StuckRanks(Feature):
    name = "stuck ranks"

    def __init__(self, run: Run) -> None:
        self.run = run
        self.started = 0.0  # unix time: dumps older than the attempt are an earlier one's

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        self.started = time.time()
        return flight.environment(env, attempt.attempt_dir, gpu=self.run.gpu.available)

    def hang(self, attempt: Attempt) -> None:
        if flight.request_dumps(attempt.env):
            log.warning("asked the ranks for their NCCL flight recorder dumps")

    def attempt_end(self, attempt: Attempt, seen: Observation) -> Mapping[str, Any]:
        if seen.hang_at is None:
            return {}
        hb = seen.heartbeats
        from rtrain.supervisor.stuck.collect import report  # at a hang only: not at start-up

        found = report(attempt.attempt_dir, hb.ranks, now=seen.hang_at, world=hb.world)
        if found is not None:
            log.warning("hang: %s", found.summary)
        dumps = flight.collect(attempt.env, attempt.attempt_dir, since=self.started,
                               mode=env_mode(attempt.env))
        return {"stuck": found.to_dict() if found else None,
                "flight_dumps": tuple(str(p) for p in dumps)}


def make(run: Run) -> StuckRanks:
    return StuckRanks(run)
