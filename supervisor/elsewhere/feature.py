"""Never a silent restart from scratch, as a feature of `rtrain launch`: when a failed attempt
leaves nothing to resume from, why is said once (decide.py), before a relaunch starts fresh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.elsewhere.scan import ElsewhereWatch
from rtrain.supervisor.launch.feature import Attempt, Feature, Run


class CheckpointsElsewhere(Feature):
    name = "cannot resume"

    def __init__(self, run: Run) -> None:
        # The script is told which checkpoint to resume from, so it needs them in the watched
        # dir: `--resume-arg`, or `{checkpoint}` in its command.
        hands = bool(run.resume_args) or any("{checkpoint}" in a for a in run.command)
        self.watch = ElsewhereWatch(hands=hands, cwd=run.cwd, ckpt_dir=run.ckpt_dir,
                                    run_dir=run.run_dir, events=run.events, say=run.say)

    def attempt_start(self, attempt: Attempt) -> None:
        self.watch.attempt_started(attempt.number, fresh=attempt.chosen is None)
        if attempt.chosen is None and (note := self.watch.launch_note()):
            attempt.notes.append(f": {note}")

    def attempt_end(self, attempt: Attempt, seen: Observation) -> Mapping[str, Any]:
        self.watch.attempt_ended(seen)
        return {}


def make(run: Run) -> CheckpointsElsewhere:
    return CheckpointsElsewhere(run)
