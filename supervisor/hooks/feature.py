"""Hooks, as a feature of `rtrain launch`: the `[[hooks]]` commands run on the events they name
(runner.py), each to its deadline, never in the loop's way."""

from __future__ import annotations

from typing import Any

from rtrain.supervisor.core import protocol
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.launch.feature import Feature, Run
from rtrain.supervisor.proc.watch import Sample


class Hooks(Feature):
    name = "hooks"

    def __init__(self, run: Run) -> None:
        from rtrain.supervisor.hooks.runner import HookRunner  # only where hooks are set

        self.runner = HookRunner(run.config.hooks, cwd=run.cwd,
                                 env={protocol.ENV_RUN_DIR: str(run.run_dir.resolve())})
        self.runner.report = run.events.emit

    def event(self, event: dict[str, Any]) -> None:
        self.runner(event)

    def sample(self, sample: Sample) -> None:
        self.runner.poll()  # hooks past their deadline

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        self.runner.poll()

    def pids(self) -> list[int]:
        return self.runner.pids()

    def close(self) -> None:
        self.runner.close()  # a give-up alert runs to its deadline


def make(run: Run) -> Hooks | None:
    return Hooks(run) if run.config.hooks else None
