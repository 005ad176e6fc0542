"""Experiment trackers across restarts: one run, one curve, and the restarts marked on it.

rtrain gives every attempt of a run the same identity (`RTRAIN_RUN_ID`) and, where the user set
none, the variables W&B and MLflow read to continue a run (supervisor/trackers/env.py).
What a resumed attempt logs again (the steps from the checkpoint's to the failure's) is each
tracker's own matter; these helpers do what its API offers:

- TensorBoard: `SummaryWriter(log_dir, purge_step=ckpt.resumed_step)`; TensorBoard drops what
  earlier attempts logged from that step on.
- W&B: `wandb_init(ckpt, ...)` rewinds the run to the step before the resumed one
  (`resume_from="<id>?_step=<k-1>"`, W&B's rewind, a preview its server must allow), so the
  replayed steps replace the earlier attempt's instead of being refused; a fresh attempt, or
  one whose rewind W&B refuses, continues the run (`resume="allow"`).
- MLflow keeps every value logged and has no way to drop one: `mlflow_start_run` continues the
  run (by `MLFLOW_RUN_ID`, else its `rtrain.run` tag) and `mlflow_log_metrics` leaves out the
  steps the run already holds, so the earlier attempt's values stand for the replayed steps.

`Restarts` reads the run's events.jsonl and, once the supervisor has measured what the failure
cost (its `recovery` event, written at the resumed attempt's first step), logs the failures that
led to this attempt to the tracker: attempt number, failure kinds, seconds lost, steps run
again, degrades.

Nothing here imports a tracker library until a helper for it is called, nor torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.supervisor.core import atomic_write, filemode, ownfiles
from rtrain.supervisor.core.protocol import (
    ENV_ATTEMPT,
    ENV_RUN_DIR,
    ENV_RUN_ID,
    ENV_STATUS,
    ENV_TRACKER_VARS,
)

log = logging.getLogger(__name__)

RUN_TAG = "rtrain.run"  # MLflow: the tag that names the rtrain run a tracker run belongs to
MLFLOW_RECORD = Path("trackers") / "mlflow-run"  # the run dir's; supervisor/trackers/env.py
ANNOTATED = "trackers-annotated"  # in an attempt dir: that attempt logged its restarts


def run_id() -> str | None:
    """The run identity rtrain gives every attempt of the run; None outside `rtrain launch`."""
    return os.environ.get(ENV_RUN_ID) or None


def _set_by_rtrain(name: str) -> bool:
    return name in os.environ.get(ENV_TRACKER_VARS, "").split(",")


def _resumed(ckpt: Any, resumed_step: int | None) -> int | None:
    return resumed_step if resumed_step is not None else getattr(ckpt, "resumed_step", None)


# --- Weights & Biases -------------------------------------------------------------------------

def wandb_init(ckpt: Any = None, *, resumed_step: int | None = None, rewind: bool = True,
               **kwargs: Any) -> Any:
    """`wandb.init(**kwargs)` continuing the run across attempts: the run id is `id=`, else
    $WANDB_RUN_ID (rtrain sets it to the run identity where you did not). In an attempt that
    resumed from step k (`ckpt.resumed_step`, or `resumed_step`) the run is rewound to step
    k-1 (W&B's rewind, `resume_from`), so the steps the attempt runs again replace those
    logged before; log with `run.log(..., step=step)` where `step` is the loop's index
    (`for step in range(start, n)`).

    W&B's rewind is a preview its server must allow for the project. Where it refuses (or with
    `rewind=False`, or your own `resume=`/$WANDB_RESUME, which W&B does not combine with it)
    the run is continued as it is and W&B refuses the replayed steps, with a warning each: the
    earlier attempt's values stand for them."""
    import wandb

    run = kwargs.pop("id", None) or os.environ.get("WANDB_RUN_ID") or run_id()
    k = _resumed(ckpt, resumed_step)
    chosen = {"resume", "resume_from", "fork_from"} & kwargs.keys()
    users_resume = "WANDB_RESUME" in os.environ and not _set_by_rtrain("WANDB_RESUME")
    if not run:
        return wandb.init(**kwargs)
    continued = {**kwargs, "id": run}
    if not chosen and not users_resume:
        continued["resume"] = "allow"
    if not (rewind and k and not chosen and not users_resume):
        return wandb.init(**continued)
    ours = os.environ.pop("WANDB_RESUME", None)  # rtrain's `allow`: W&B refuses it with a rewind
    try:
        return wandb.init(**kwargs, resume_from=f"{run}?_step={k - 1}")
    except Exception as e:  # the server's refusal has no type of its own; said, not hidden
        log.warning("W&B refused to rewind run %s to step %d (%s): continuing it as it is; "
                    "W&B refuses the steps from %d to the last one it holds", run, k - 1, e, k)
        if ours is not None:
            os.environ["WANDB_RESUME"] = ours
        return wandb.init(**continued)


# --- MLflow -----------------------------------------------------------------------------------

def mlflow_start_run(**kwargs: Any) -> Any:
    """`mlflow.start_run(**kwargs)` continuing the run across attempts: `run_id=`, else
    $MLFLOW_RUN_ID (rtrain sets it from the second attempt on), else the run of the active
    experiment tagged `rtrain.run=<run identity>` (a fresh machine resuming from the mirror),
    else a new run with that tag. The run's id is recorded in the run dir for the next attempt."""
    import mlflow

    ident = run_id()
    if "run_id" not in kwargs and not os.environ.get("MLFLOW_RUN_ID") and ident:
        found = mlflow.search_runs(filter_string=f"tags.`{RUN_TAG}` = '{ident}'",
                                   max_results=1, output_format="list")
        if found:
            kwargs["run_id"] = found[0].info.run_id
        else:
            kwargs["tags"] = {**(kwargs.get("tags") or {}), RUN_TAG: ident}
    active = mlflow.start_run(**kwargs)
    _record_mlflow_run(ident, active.info.run_id)
    return active


def _record_mlflow_run(ident: str | None, mlflow_run: str) -> None:
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not ident or not run_dir:
        return
    path = Path(run_dir) / MLFLOW_RECORD
    try:  # never into whatever a link planted at `trackers` points to
        ownfiles.own_dir(path.parent, filemode.env_mode(os.environ))
        atomic_write.write_atomic(path, f"{ident} {mlflow_run}\n")
    except OSError as e:  # the next attempt finds the run by its tag
        log.warning("cannot record the MLflow run id in %s: %s", path, e)


_mlflow_last: dict[tuple[str, str], int] = {}  # (run id, key): the newest step the run holds


def mlflow_log_metrics(metrics: dict[str, float], step: int) -> dict[str, float]:
    """`mlflow.log_metrics(metrics, step=step)` for the keys whose history in the active run
    ends before `step`: a step an earlier attempt logged is not logged again (MLflow would
    keep both values and draw the curve back and forth). Returns what was logged."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("no active MLflow run: call rtrain.trackers.mlflow_start_run() first")
    rid = run.info.run_id
    new = {}
    for key, value in metrics.items():
        if (rid, key) not in _mlflow_last:
            history = mlflow.MlflowClient().get_metric_history(rid, key)
            _mlflow_last[rid, key] = max((m.step for m in history), default=-1)
        if step > _mlflow_last[rid, key]:
            new[key] = value
            _mlflow_last[rid, key] = step
    if new:
        mlflow.log_metrics(new, step=step)
    return new


# --- Restarts ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Restart:
    """The failures that led to one resumed attempt, as its `recovery` events measured them."""

    attempt: int
    """The attempt that resumed (RTRAIN_ATTEMPT)."""
    failures: tuple[tuple[int, str], ...]
    """(failed attempt, failure kind) of each, oldest first: several when relaunches failed
    before their first step."""
    lost_s: float
    """Seconds lost: from each failure to the next first step, plus the work run again."""
    steps_again: int
    """Steps run again: the failed attempts' last steps minus the steps resumed from."""
    resumed_step: int | None
    degrades: tuple[str, ...]
    """What each degrade changed (`batch_size 8 -> 4`, ...)."""

    def metrics(self) -> dict[str, float]:
        return {"rtrain/attempt": self.attempt, "rtrain/failures": len(self.failures),
                "rtrain/lost_s": round(self.lost_s, 3), "rtrain/steps_again": self.steps_again,
                "rtrain/degrades": len(self.degrades)}

    def sentence(self) -> str:
        causes = ", ".join(f"attempt {a} {kind}" for a, kind in self.failures)
        degraded = f"; degraded: {'; '.join(self.degrades)}" if self.degrades else ""
        return (f"attempt {self.attempt} resumed from step {self.resumed_step} after {causes}: "
                f"{self.lost_s:.1f} s lost, {self.steps_again} steps run again{degraded}")


def fold(events: Iterable[dict[str, Any]], attempt: int, since: int) -> Restart | None:
    """The failures from attempt `since` on that led to `attempt`, once `attempt`'s own
    `recovery` event is among `events`; None before (pure). Relaunches that failed before
    their first step (`recovery` with `complete` false) fold into the attempt that got there."""
    recoveries, degrades = [], {}
    for e in events:
        if e.get("kind") == "recovery" and since < e.get("attempt", -1) <= attempt:
            recoveries.append(e)
        elif e.get("kind") == "degrade":
            degrades.setdefault(e.get("attempt"), []).append(str(e.get("change")))
    if not any(e["attempt"] == attempt for e in recoveries):
        return None
    recoveries.sort(key=lambda e: e["attempt"])
    return Restart(
        attempt=attempt,
        failures=tuple((e.get("failed_attempt"), e.get("failure")) for e in recoveries),
        lost_s=sum(e.get("lost_s") or e.get("total_s") or 0.0 for e in recoveries),
        steps_again=sum(e.get("steps_lost") or 0 for e in recoveries),
        resumed_step=recoveries[-1].get("resumed_step"),
        degrades=tuple(c for e in recoveries for c in degrades.get(e.get("failed_attempt"), ())))


class Restarts:
    """Marks on the tracker where the run restarted and why. Call `log(tracker, step)` after
    logging each step: it costs a stat of events.jsonl until the supervisor records what the
    failure cost (at the attempt's first step), then logs it once (`tracker`: a wandb Run, a
    SummaryWriter, the `mlflow` module, or a callable taking the Restart) and does nothing
    more. The failures logged are those since the last attempt that logged its own: none is
    logged twice, none lost when a relaunch dies before its first step. Outside `rtrain
    launch`, and in a run's first attempt, it does nothing. Under torchrun, use it where the
    tracker is (rank 0): the first rank to log marks the attempt as done."""

    def __init__(self) -> None:
        run_dir, status = os.environ.get(ENV_RUN_DIR), os.environ.get(ENV_STATUS)
        attempt = os.environ.get(ENV_ATTEMPT, "")
        self._attempt = int(attempt) if attempt.isdigit() else 0
        self._done = not (run_dir and status and self._attempt > 0)
        self._events = Path(run_dir or ".") / "events.jsonl"
        self._marker = Path(status or ".") / ANNOTATED
        self._since = -1 if self._done else _last_annotated(Path(run_dir or "."), self._attempt)
        self._offset, self._seen, self._tail = 0, [], b""

    def poll(self) -> Restart | None:
        """The restart to log, once, when the supervisor has recorded it; else None."""
        if self._done:
            return None
        self._read_new()
        restart = fold(self._seen, self._attempt, self._since)
        if restart is not None:
            self._done = True
            try:
                os.close(ownfiles.open_own(self._marker, create=True,
                                           mode=filemode.env_mode(os.environ)).fd)
            except OSError as e:  # the next attempt logs these failures again
                log.warning("cannot mark %s: %s", self._marker, e)
        return restart

    def log(self, tracker: Any, step: int) -> Restart | None:
        restart = self.poll()
        if restart is not None:
            write(tracker, restart, step)
        return restart

    def _read_new(self) -> None:
        try:  # as the supervisor reads it: no link, no FIFO, only what is there now
            opened = ownfiles.open_own(self._events)
        except OSError:
            return
        try:
            size = opened.st.st_size
            if size <= self._offset:
                return
            chunk = self._tail + os.pread(opened.fd, size - self._offset, self._offset)
        except OSError:
            return
        finally:
            os.close(opened.fd)
        self._offset = size
        *lines, self._tail = chunk.split(b"\n")
        for line in lines:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and e.get("kind") in ("recovery", "degrade"):
                self._seen.append(e)


def _last_annotated(run_dir: Path, attempt: int) -> int:
    """The newest earlier attempt that logged its restarts (-1: none)."""
    for a in range(attempt - 1, -1, -1):
        if (run_dir / "attempts" / str(a) / ANNOTATED).exists():
            return a
    return -1


def write(tracker: Any, restart: Restart, step: int) -> None:
    """Log `restart` at `step` to a wandb Run, a torch/tensorboardX SummaryWriter, the `mlflow`
    module (its active run) or a callable."""
    kind = type(tracker).__module__
    if kind.startswith("wandb"):
        tracker.log({**restart.metrics(), "rtrain/restart": restart.sentence()}, step=step)
    elif kind.startswith(("torch.utils.tensorboard", "tensorboardX")):
        for key, value in restart.metrics().items():
            tracker.add_scalar(key, value, step)
        tracker.add_text("rtrain/restart", restart.sentence(), step)
    elif getattr(tracker, "__name__", "") == "mlflow":
        tracker.log_metrics(restart.metrics(), step=step)
        tracker.set_tag(f"rtrain.restart.{restart.attempt}", restart.sentence())
    elif callable(tracker):
        tracker(restart)
    else:
        raise TypeError(f"cannot log a restart to {type(tracker).__name__}: pass a wandb Run, a "
                        "SummaryWriter, the mlflow module or a callable")
