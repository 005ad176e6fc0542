"""A small torch run that logs every step to W&B (offline), TensorBoard and MLflow (a local file
store) through worker/trackers/restarts.py, and fails three times under `rtrain launch`:

- attempt 0 SIGKILLs itself after logging step KILL0;
- attempt 1 SIGKILLs itself once it logged its restart and reached step KILL1;
- attempt 2 runs out of memory (torch.OutOfMemoryError, as CUDA raises it) once it logged its
  restart, reached step OOM and the batch size is above 4: rtrain degrades the next attempt.

Each attempt logs steps the one before it logged already (a checkpoint every 5 steps).

usage: tracker_train.py STEPS OUT KILL0 KILL1 OOM      (a negative step: no such failure)
OUT holds wandb/, tb/ and mlruns/; OUT/attempts.jsonl gets one line per attempt (its resumed
step, the run identity and the tracker variables it saw).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import mlflow
import torch
from torch.utils.tensorboard import SummaryWriter

import rtrain
from rtrain import trackers

steps, out = int(sys.argv[1]), Path(sys.argv[2]).resolve()
kill0, kill1, oom_at = (int(a) for a in sys.argv[3:6])
kill_at = {a: s for a, s in ((0, kill0), (1, kill1)) if s >= 0}
attempt = int(os.environ["RTRAIN_ATTEMPT"])
rtrain.install_excepthook()
batch = rtrain.settings(batch_size=8).batch_size

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
# Resumes from the disk saves every 5 steps (the tests name them): no memory tier.
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=5, keep=None,
                         saving=rtrain.Saving(memory=None))
start = ck.restore()
with open(out / "attempts.jsonl", "a") as f:
    f.write(json.dumps({"attempt": attempt, "resumed_step": ck.resumed_step,
                        **{k: os.environ.get(k) for k in (
                            "RTRAIN_RUN_ID", "WANDB_RUN_ID", "WANDB_RESUME",
                            "MLFLOW_RUN_ID")}}) + "\n")

run = trackers.wandb_init(ck, project="rtrain-trackers", mode="offline", dir=str(out))
writer = SummaryWriter(str(out / "tb"), purge_step=ck.resumed_step)
mlflow.set_tracking_uri((out / "mlruns").as_uri())
mlflow.set_experiment("rtrain-trackers")
trackers.mlflow_start_run()
restarts = trackers.Restarts()
annotated = attempt == 0

for step in range(start, steps):
    x = torch.randn(batch, 16)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    metrics = {"loss": loss.item(), "batch_size": float(batch)}
    run.log(metrics, step=step)
    writer.add_scalar("loss", metrics["loss"], step)
    trackers.mlflow_log_metrics(metrics, step)
    restart = restarts.poll()
    if restart is not None:
        for tracker in (run, writer, mlflow):
            trackers.write(tracker, restart, step)
        annotated = True
    writer.flush()  # what a kill would find on disk
    if annotated and step >= kill_at.get(attempt, steps):
        # W&B writes its offline file every WANDB__TRANSACTION_LOG_FLUSH_INTERVAL seconds
        # (15 by default): a kill loses what it had not written yet.
        time.sleep(3 * float(os.environ.get("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "0")))
        os.kill(os.getpid(), signal.SIGKILL)
    if annotated and attempt == 2 and 0 <= oom_at <= step and batch > 4:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    time.sleep(0.05)
    ck.maybe_save(step + 1, metrics={"loss": metrics["loss"]})

writer.close()
mlflow.end_run()
run.finish()
ck.close()
