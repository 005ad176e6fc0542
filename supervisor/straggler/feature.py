"""Stragglers, as a feature of `rtrain launch`: each attempt's ranks compared step by step
(track.py, decide.py); a rank much slower than the others is said, and with `exclude_node` a
requeue leaves this node when one of its ranks straggled."""

from __future__ import annotations

from rtrain.supervisor.core.event_schema import Kind
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.policy import Action, Decision
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.proc import slurm
from rtrain.supervisor.straggler.decide import StragglerRule
from rtrain.supervisor.straggler.track import StragglerTracker


class Stragglers(Feature):
    name = "straggler"

    def __init__(self, run: Run) -> None:
        st = run.config.straggler
        self.run, self.exclude = run, st.exclude_node
        self.rule = StragglerRule(factor=st.factor, window_steps=st.window_steps,
                                  min_samples=st.min_samples)
        self.tracker = StragglerTracker(self.rule)
        self.here: str | None = None  # the attempt's last straggler, said

    def attempt_start(self, attempt: Attempt) -> None:
        # Each attempt's ranks are compared afresh (a relaunch may run on other nodes).
        self.tracker, self.here = StragglerTracker(self.rule), None

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        for found in self.tracker.heartbeat(hb):
            s = found.straggler
            detail = s.describe() + (f" on {found.host}" if found.host else "")
            self.run.events.emit(
                Kind.STRAGGLER, attempt=attempt, step=s.step, rank=s.rank, host=found.host,
                ratio=round(s.ratio, 3), busy_s=round(s.busy_s, 6),
                others_busy_s=round(s.others_busy_s, 6), ranks=found.ranks,
                window_steps=self.rule.window_steps, detail=detail)
            self.run.say(f"straggler: {detail}")
            self.here = detail

    def run_end(self, decision: Decision) -> None:
        """A requeue after an attempt in which a rank on this node straggled: excluded as after
        a failed device (unless the decision excludes it already)."""
        if (decision.action is not Action.REQUEUE or decision.exclude_node or not self.exclude
                or self.here is None):
            return
        self.run.say(f"excluding this node from the job: {self.here}")
        done, what = slurm.exclude_node()
        self.run.events.emit("exclude_node", done=done, detail=what)
        self.run.say(what)


def make(run: Run) -> Stragglers | None:
    return Stragglers(run) if run.config.straggler.enabled else None
