"""The variables experiment trackers read to continue one run across attempts: one run, one
curve. `variables` is pure: the names and values from the run identity, what the user already
set and what the worker's helpers recorded in the run dir (`read_mlflow_run`).

- Weights & Biases: `WANDB_RUN_ID` the run identity and `WANDB_RESUME=allow` (a new run if the
  tracker has none under that id, else the same one continued). A user's own `WANDB_RUN_ID`
  wins, and then their `WANDB_RESUME` (set or not) is theirs too.
- MLflow: `MLFLOW_RUN_ID` must name a run that exists, so it is never made up: the first attempt
  gets none (`rtrain.trackers.mlflow_start_run` creates the run tagged with the identity) and
  later ones get the id that helper recorded in the run dir (`trackers/mlflow-run`). A fresh
  machine without that record finds the run by its tag.
- TensorBoard reads no variable: the log dir is the user's; `Checkpointer.resumed_step` is the
  step to purge from.

Each variable is set only where the user's environment does not have it already. The names set
go to the child in `RTRAIN_TRACKER_VARS` so the worker's helpers may override rtrain's choice
(W&B's rewind cannot be combined with `WANDB_RESUME`), never the user's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from rtrain.supervisor.core import ownfiles, protocol

# In the run dir, written by the worker's helper: `<run identity> <MLflow run id>`, one line.
MLFLOW_RECORD = Path("trackers") / "mlflow-run"
_MLFLOW_RECORD_MAX = 256  # the identity, a space and an id of at most 64 characters
_MLFLOW_ID = re.compile(r"[0-9a-zA-Z_-]{1,64}")  # MLflow's run ids are 32 hex digits


def variables(run: str | None, env: Mapping[str, str],
              mlflow_run: str | None) -> dict[str, str]:
    """The variables to add to an attempt's environment `env`: the run identity, and each
    tracker's own that `env` lacks (with `RTRAIN_TRACKER_VARS` naming the latter). `run`: the
    launch's identity (None: it has none, nothing is set); `mlflow_run`: the MLflow run id the
    run dir records (`read_mlflow_run`)."""
    if run is None:
        return {}
    out = {protocol.ENV_RUN_ID: run}
    if "WANDB_RUN_ID" not in env:
        out["WANDB_RUN_ID"] = run
        if "WANDB_RESUME" not in env:
            out["WANDB_RESUME"] = "allow"
    if mlflow_run is not None and "MLFLOW_RUN_ID" not in env:
        out["MLFLOW_RUN_ID"] = mlflow_run
    ours = [name for name in out if name != protocol.ENV_RUN_ID]
    if ours:
        out[protocol.ENV_TRACKER_VARS] = ",".join(ours)
    return out


def read_mlflow_run(run_dir: Path, run: str | None) -> str | None:
    """The MLflow run id the worker's helper recorded for the run `run`; None: none, or one
    recorded for another run (the dir's earlier run, started over since). Read as every file
    in the run dir is (`ownfiles`): a FIFO, a link or an oversized file planted at the name is
    refused unread (`ownfiles.RefusedFile`, the line to say), never waited on."""
    try:
        raw = ownfiles.read_own(run_dir / MLFLOW_RECORD, limit=_MLFLOW_RECORD_MAX,
                                what="MLflow run record")
    except ownfiles.RefusedFile:
        raise
    except OSError:  # absent (the first attempt), unreadable
        return None
    fields = raw.decode("ascii", errors="replace").split()
    if len(fields) != 2 or run is None or fields[0] != run:
        return None
    return fields[1] if _MLFLOW_ID.fullmatch(fields[1]) else None
