"""The memory tier, as a feature of `rtrain launch`: the worker's snapshots in shared memory
(tier.py), committed to disk when they are the newest state, resumed from when they hold the
chosen checkpoint, copied to and from peer nodes under several nodes, dropped under memory
pressure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.memtier.tier import MemoryTierDir
from rtrain.supervisor.pressure.monitor import PressureNote
from rtrain.supervisor.proc import torchrun
from rtrain.supervisor.proc.watch import Sample


class MemoryTier(Feature):
    name = "memory tier"

    def __init__(self, run: Run) -> None:
        self.run = run
        self.tier = MemoryTierDir(run.ckpt_dir, run.checkpoints.key, run.events.emit, run.say,
                                  file_mode=run.config.file_mode)
        run.checkpoints.in_flight = self.tier  # an attempt's last state, still being copied
        if torchrun.several_nodes(run.command):  # copies on peer nodes
            rdzv = torchrun.rdzv_host(run.command)
            from rtrain.supervisor.memtier.peerside import serving_address

            self.tier.enable_peers(*serving_address(rdzv), rdzv_host=rdzv)

    def _disk_newest(self) -> int | None:
        return self.run.checkpoints.newest_step()

    def start(self, *, new_run: bool, starting_over: bool) -> None:
        if starting_over:
            self.tier.discard()
        else:  # snapshots an rtrain that ended without persisting them left in memory
            self.tier.commit_newest(self._disk_newest(), "found at launch")

    def attempt_start(self, attempt: Attempt) -> None:
        chosen = attempt.chosen
        self.tier.newest_allowed = attempt.newest_allowed
        self.tier.attempt_starting(attempt.number, chosen.step if chosen is not None else None)
        in_memory = self.tier.resume_path(chosen)  # the same checkpoint, read from memory
        if in_memory is not None:
            attempt.read_from, attempt.tier = in_memory, "memory"
            attempt.notes.append(", read from the memory tier")

    def environment(self, attempt: Attempt, env: Mapping[str, str]) -> Mapping[str, str]:
        return self.tier.env()

    def sample(self, sample: Sample) -> None:
        self.tier.poll()

    def heartbeat(self, attempt: int, hb: Heartbeat) -> None:
        self.tier.heartbeat(attempt, hb)

    def pressure(self, attempt: int, note: PressureNote) -> None:
        # After the standby (which went first on rising pressure): the snapshots.
        if note.reading.source in ("cgroup", "host") and note.action != "rising":
            self.tier.drop(attempt, f"memory pressure: {note.why or note.reading.describe()}")

    def attempt_end(self, attempt: Attempt, seen: Observation) -> Mapping[str, Any]:
        # Before anything reads the checkpoint dir (the progress rule, the next pick): the
        # newest snapshot, if newer, is the newest verified state now (a disk save rtrain was
        # copying for the worker is finished first). A live state sealed now is copied while
        # the relaunch resumes from it in memory (background_commit.py).
        self.tier.commit_newest(self._disk_newest(), "attempt ended", durable_later=True,
                                background=True)
        return {}

    def close(self) -> None:
        # The child is gone: its newest snapshot is the newest state, if newer than the disk's.
        self.tier.close(self._disk_newest())


def make(run: Run) -> MemoryTier:
    return MemoryTier(run)
