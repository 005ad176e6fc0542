"""Bench child, run by `rtrain launch --nproc-per-node 2`: DDP steps of ~20 ms; in attempt 0
rank 1 notes the time and SIGKILLs itself at step KILL_AT; in attempt 1 rank 0 notes the time
of its first step after the restore. Times go to OUT_DIR/{killed,stepping}."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import rtrain

out, kill_at, total = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank = dist.get_rank()
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=10, keep=2)
step = ck.restore()
first = True
while step < total:
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    step += 1
    ck.maybe_save(step)
    if first and attempt > 0 and rank == 0:
        (out / "stepping").write_text(repr(time.time()))
    first = False
    if attempt == 0 and rank == 1 and step == kill_at:
        (out / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
dist.destroy_process_group()
