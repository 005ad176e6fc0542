"""The warm standby, as a feature of `rtrain launch`: an interpreter with the script's heavy
modules imported waits beside the running attempt and starts the next one (slot.py); it makes
room first under memory pressure and ends when no relaunch follows."""

from __future__ import annotations

from collections.abc import Callable

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.attempt import group_broke_at
from rtrain.supervisor.decide.classify import nodes_taken_in
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.decide.policy import Action, Decision
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.pressure.monitor import PressureNote
from rtrain.supervisor.proc.spawn import Child, ChildSpec, spawn
from rtrain.supervisor.proc.watch import Sample
from rtrain.supervisor.standby import rank_host
from rtrain.supervisor.standby.slot import StandbySlot
from rtrain.supervisor.standby.warm_child import LOG_NAME

IN_PLACE = {"run": (LOG_NAME,)}  # features.in_place


class Standby(Feature):
    name = "standby"

    def __init__(self, slot: StandbySlot) -> None:
        self.slot = slot

    def spawn(self, spec: ChildSpec, attempt: Attempt,
              interrupted: Callable[[], bool]) -> tuple[Child, float] | None:
        child, start_s = self.slot.start(spec, attempt.number, interrupted=interrupted)
        return None if child is None else (child, start_s)

    def sample(self, sample: Sample) -> None:
        self.slot.tick(sample.tree)

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        self.slot.heartbeat()

    def pressure(self, attempt: int, note: PressureNote) -> None:
        # The standby counts where the run's memory does: it goes before anything is asked
        # of the training.
        if note.reading.source in ("cgroup", "host"):
            self.slot.make_room(note.why or note.reading.describe())

    def attempt_end(self, attempt: Attempt, seen: Observation) -> dict:
        # A group stopped to take a waiting node in: the next round waits for that node.
        self.slot.after_growth = (seen.exit_code == rank_host.GROW_EXIT
                                  and nodes_taken_in(seen.stderr_tail) is not None)
        # The survivors of a failure of warm ranks come back within a second of the moment their
        # group broke: the next round's last call counts from it (standby/rank_rdzv.py).
        # torchrun's agent takes its own time to end (it imported torch): a second from the
        # join, as before.
        self.slot.failed_at = group_broke_at(seen) if self.slot.hosted else None
        return {}

    def run_end(self, decision: Decision) -> None:
        if decision.action is not Action.RELAUNCH:
            self.slot.close()  # its memory back before the run's last waits

    def pids(self) -> list[int]:
        return self.slot.pids()

    def close(self) -> None:
        self.slot.close()


def make(run: Run) -> Standby | None:
    # A scripted spawner (tests) has no interpreter to keep warm.
    if not run.config.standby or run.seams.spawn is not spawn:
        return None
    slot = StandbySlot(run.config, run.command, run.cwd, run.run_dir, run.events, run.say)
    return Standby(slot) if slot.enabled else None
