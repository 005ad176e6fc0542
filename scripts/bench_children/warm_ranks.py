"""Bench child of scripts/bench_warm_ranks.py: two DDP ranks on gloo, steps of ~20 ms, a
checkpoint every 10. Rank 0 writes OUT/steady at step 50 of the first run; in the first run
rank 1 SIGKILLs itself at the first step after OUT/kill appears, noting the time in OUT/killed;
in a later run rank 0 notes the time of its first step after the restore in OUT/stepping, and
stops 20 steps later. The run is the first when RTRAIN_ATTEMPT (under rtrain) or BENCH_RUN
(the torchrun loop) is 0."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import rtrain

out, total = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
first_run = int(os.environ.get("RTRAIN_ATTEMPT") or os.environ.get("BENCH_RUN") or 0) == 0
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=10, keep=2)
step = ck.restore()
end = total if first_run else step + 20  # a later run: a few steps past the restore
first = True
while step < end:
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    step += 1
    ck.maybe_save(step)
    if first and not first_run and rank == 0:
        (out / "stepping").write_text(repr(time.time()))
    first = False
    if first_run and rank == 0 and step == 50:
        (out / "steady").write_text(repr(time.time()))
    if first_run and rank == 1 and (out / "kill").exists():
        (out / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
dist.destroy_process_group()
