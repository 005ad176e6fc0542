"""Checkpoints elsewhere, as a feature of `rtrain launch`: a script that writes its checkpoints
somewhere rtrain does not watch is found and said (scan.py), before a relaunch starts it fresh."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.elsewhere.scan import ElsewhereWatch
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.proc.watch import Sample


class CheckpointsElsewhere(Feature):
    name = "checkpoints elsewhere"

    def __init__(self, run: Run) -> None:
        # The script is told which checkpoint to resume from, so it needs them in the watched
        # dir: `--resume-arg`, or `{checkpoint}` in its command.
        hands = bool(run.resume_args) or any("{checkpoint}" in a for a in run.command)
        self.watch = ElsewhereWatch(
            after_s=run.config.checkpoints_elsewhere_after_s, expects=hands, cwd=run.cwd,
            ckpt_dir=run.ckpt_dir, run_dir=run.run_dir, events=run.events, say=run.say,
            monotonic=run.seams.monotonic)

    def attempt_start(self, attempt: Attempt) -> None:
        if attempt.chosen is None and (note := self.watch.launch_note()):
            attempt.notes.append(f": {note}")
        self.watch.attempt_started(attempt.number)

    def sample(self, sample: Sample) -> None:
        self.watch.poll()

    def attempt_end(self, attempt: Attempt, seen: Observation) -> Mapping[str, Any]:
        self.watch.attempt_ended()
        return {}


def make(run: Run) -> CheckpointsElsewhere:
    return CheckpointsElsewhere(run)
