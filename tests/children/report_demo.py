"""A torch-free training run for `rtrain report`: heartbeats with a loss and samples, a real
checkpoint every EVERY steps (the supervisor's own commit protocol), resume from
RTRAIN_RESUME_FROM; attempt 0 crashes at CRASH_AT, attempt 1 prints a CUDA out-of-memory error
at OOM_AT while batch_size > 16, later attempts finish.

usage: report_demo.py STEPS [STEP_S] [EVERY] [CRASH_AT] [OOM_AT]
"""

import math
import os
import random
import sys
import time

import numpy as np

import rtrain
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.safetensors_io import TensorBlob
from rtrain.worker import runtime

steps = int(sys.argv[1])
step_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.02
every = int(sys.argv[3]) if len(sys.argv) > 3 else 20
crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else steps // 3
oom_at = int(sys.argv[5]) if len(sys.argv) > 5 else steps * 2 // 3
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
s = rtrain.settings(batch_size=32, grad_accum=1)
resume = os.environ.get("RTRAIN_RESUME_FROM")
start = int(resume.rsplit("-", 1)[1]) if resume else 0
ckpt_dir = os.environ.get("RTRAIN_CKPT_DIR", "checkpoints")
rng = random.Random(attempt)
runtime.install()


def save(step: int, loss: float) -> None:
    pending = PendingCheckpoint(ckpt_dir, step, fsync=False)
    weights = np.full(8, step, np.float32)
    pending.write_tensors("model.safetensors",
                          [TensorBlob("w", "F32", (8,), memoryview(weights))])
    pending.write_json("state.json", {"step": step})
    pending.commit({"epoch": 0, "samples_seen": step * 32, "fingerprint": "f" * 32,
                    "environment": {"python": sys.version.split()[0], "torch": None},
                    "settings": {"batch_size": s.batch_size, "grad_accum": s.grad_accum},
                    "metrics": {"loss": loss}, "info": {}})


for step in range(start + 1, steps + 1):
    # Smaller batches run more steps per second but fewer samples per second.
    time.sleep(step_s * (0.5 + 0.5 * s.batch_size / 32))
    loss = 2.4 * math.exp(-step / (steps / 4)) + 0.35 + rng.uniform(-0.04, 0.04)
    rtrain.heartbeat(step=step, loss=loss, samples=s.batch_size)
    if step % every == 0:
        save(step, loss)
    if attempt == 0 and step == crash_at:
        print("Traceback (most recent call last):\nRuntimeError: injected crash",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if attempt == 1 and step == oom_at and s.batch_size > 16:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if rtrain.should_stop():
        sys.exit(75)
print("done", flush=True)
