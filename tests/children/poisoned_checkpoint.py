"""Trains with step heartbeats and commits a checkpoint every 5 steps (torch-free format
layer). Attempt 0 writes a poisoned checkpoint at step POISON: every attempt that resumes from
it crashes at its first step. Any other attempt resuming from an earlier checkpoint passes
through step POISON cleanly and finishes.

usage: poisoned_checkpoint.py CKPT_DIR TOTAL POISON
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

import rtrain
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.layout import parse_step
from rtrain.checkpoint.safetensors_io import TensorBlob
from rtrain.worker import runtime

ckpt_dir, total, poison = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
resume = os.environ.get("RTRAIN_RESUME_FROM")
runtime.install()
step, poisoned = 0, False
if resume:
    step = parse_step(Path(resume).name)
    poisoned = json.loads((Path(resume) / "state.json").read_text()).get("poison", False)
print(f"attempt {attempt} from {resume} (step {step}, poisoned {poisoned})", flush=True)
while step < total:
    step += 1
    time.sleep(0.01)
    rtrain.heartbeat(step=step, loss=1.0 / step, samples=8)
    if poisoned:
        print("Traceback (most recent call last):\nRuntimeError: loss is nan (bad state)",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if step % 5 == 0:
        p = PendingCheckpoint(ckpt_dir, step, fsync=False)
        a = np.full(16, step, dtype=np.int64)
        p.write_tensors("model.safetensors", [TensorBlob("w", "I64", a.shape, memoryview(a))])
        p.write_json("state.json", {"step": step, "poison": attempt == 0 and step == poison})
        p.commit({"epoch": 0, "samples_seen": step * 8})
    if attempt == 0 and step == poison + 2:
        sys.exit(1)  # the poison strikes the run that wrote it too
print("done", flush=True)
