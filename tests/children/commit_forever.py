"""Commits checkpoints with the torch-free format layer until killed; every byte of the
checkpoint for step S is S % 251, so a reader can check that a picked checkpoint is whole.

usage: commit_forever.py CKPT_DIR
"""

import sys

import numpy as np

from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.safetensors_io import TensorBlob

ckpt_dir = sys.argv[1]
existing = list_checkpoints(ckpt_dir)
step = existing[0][0] if existing else 0
print("ready", flush=True)
while True:
    step += 1
    arrays = [np.full(1 << 20, step % 251, dtype=np.uint8) for _ in range(4)]
    p = PendingCheckpoint(ckpt_dir, step)
    for i, a in enumerate(arrays):
        p.write_tensors(f"part{i}.safetensors", [TensorBlob("t", "U8", a.shape, memoryview(a))])
    p.write_json("state.json", {"step": step})
    p.commit({"epoch": 0, "samples_seen": 0})
