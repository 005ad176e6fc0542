"""Commits STEPS checkpoints of PARTS files of MIB MiB each with the torch-free format layer,
one every INTERVAL seconds, then waits until stopped (SIGTERM: exit 75, as a worker that has
nothing newer to save). Every byte of checkpoint S is S % 251. Continues from the newest
checkpoint in CKPT_DIR. Prints "committed S" after each commit. With COMMIT_BIG_KILL_SELF=1
the first attempt (RTRAIN_ATTEMPT 0) SIGKILLs itself right after its last commit instead.

usage: commit_big.py CKPT_DIR MIB STEPS [INTERVAL] [PARTS]
"""

import os
import signal
import sys
import time

import numpy as np

from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.safetensors_io import TensorBlob

ckpt_dir, mib, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
interval = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
parts = int(sys.argv[5]) if len(sys.argv) > 5 else 4
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
existing = list_checkpoints(ckpt_dir)
step = existing[0][0] if existing else 0
while step < steps:
    step += 1
    p = PendingCheckpoint(ckpt_dir, step)
    for i in range(parts):
        a = np.full(mib << 20, step % 251, dtype=np.uint8)
        p.write_tensors(f"part{i}.safetensors", [TensorBlob("t", "U8", a.shape, memoryview(a))])
    p.write_json("state.json", {"step": step})
    p.commit({"epoch": 0, "samples_seen": 0})
    print(f"committed {step}", flush=True)
    time.sleep(interval)
if os.environ.get("COMMIT_BIG_KILL_SELF") == "1" and os.environ.get("RTRAIN_ATTEMPT") == "0":
    os.kill(os.getpid(), signal.SIGKILL)
while True:
    time.sleep(3600)
