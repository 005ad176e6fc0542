"""The mirror, as a feature of `rtrain launch`: the run's checkpoints uploaded to object storage
or another filesystem as they are committed (launch_uploads.py, uploader.py), a newer one
brought back before the first pick on a fresh machine (fetch_newer.py), and the newest sent
before rtrain exits."""

from __future__ import annotations

from rtrain.supervisor.decide.policy import Decision
from rtrain.supervisor.launch.feature import Attempt, Feature, Run
from rtrain.supervisor.mirror import launch_uploads
from rtrain.supervisor.mirror.uploader import LOCK_NAME
from rtrain.supervisor.proc.watch import Sample

IN_PLACE = {"run": (launch_uploads.LOG_NAME,), "ckpt": (LOCK_NAME,)}  # features.in_place


class Mirror(Feature):
    name = "mirror"

    def __init__(self, run: Run) -> None:
        self.run = run
        self.mirroring: launch_uploads.Mirroring | None = None  # opened by start()

    def start(self, *, new_run: bool, starting_over: bool) -> None:
        # Probed only now: a finished run relaunched from cron pays no store round trip, and
        # bad credentials still stop the launch before any attempt (UsageError).
        run = self.run
        self.mirroring = launch_uploads.open_for(run.config, run.run_dir, run.ckpt_dir,
                                                 run.events, run.say, new_run=new_run)
        if self.mirroring is not None:
            from rtrain.supervisor.mirror.fetch_newer import NewerOnMirror  # only with a mirror

            run.checkpoints.fetch_newer = NewerOnMirror(
                self.mirroring, run.ckpt_dir, run.checkpoints.key,
                file_mode=run.config.file_mode, events=run.events, say=run.say)

    def attempt_start(self, attempt: Attempt) -> None:
        if self.mirroring is not None:
            # After the first pick, which settles the run identity it uploads under.
            self.mirroring.start()

    def sample(self, sample: Sample) -> None:
        if self.mirroring is not None:
            self.mirroring.poll()

    def run_end(self, decision: Decision) -> None:
        # The newest checkpoint goes to the mirror before rtrain exits (under preemption,
        # within what the grace leaves; see mirror_final_wait_s).
        if self.mirroring is not None:
            self.mirroring.finish(self.run.config.mirror_final_wait_s)

    def pids(self) -> list[int]:
        return self.mirroring.pids() if self.mirroring is not None else []

    def close(self) -> None:
        if self.mirroring is not None:
            self.mirroring.close()


def make(run: Run) -> Mirror | None:
    return Mirror(run) if run.config.mirror is not None else None
