"""Bench child of scripts/bench_warm_ranks.py: two DDP ranks on gloo, steps of ~20 ms, a
checkpoint every 10. The run number is RTRAIN_ATTEMPT (under rtrain) or BENCH_RUN (the torchrun
loop); BENCH_KILL_RUN (default 0) names the run that is killed. A run before it: rank 1
SIGKILLs itself at its 30th step. That run: rank 0 writes OUT/steady at its 50th step, and rank
1 SIGKILLs itself at the first step after OUT/kill appears, noting the time in OUT/killed. A run
started once OUT/killed exists (the run after it; over two nodes, where the benchmark kills a
whole node and writes OUT/killed itself, each node's next run): rank 0 notes the time of its
first step after the restore in OUT/stepping, and the run stops 20 steps later; with
BENCH_GROW=1 (`--nnodes 1:2`) only a run of both nodes does, once the group grew back."""

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
run = int(os.environ.get("RTRAIN_ATTEMPT") or os.environ.get("BENCH_RUN") or 0)
kill_run = int(os.environ.get("BENCH_KILL_RUN") or 0)
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
# Over a range of nodes the group may resume at another size (the checkpoint is replicated).
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=10, keep=2,
                         restoring=rtrain.Restoring(allow_resize=True))
step = ck.restore()
if rank == 0:  # the group's size in each run, in order (the benchmark reads it back)
    with open(out / "worlds", "a") as f:
        f.write(f"{dist.get_world_size()}\n")
after = (out / "killed").exists()
grow = os.environ.get("BENCH_GROW") == "1"
# After the kill: a few steps past the restore (over a range, past the one at two nodes).
end = step + 20 if after and (not grow or dist.get_world_size() == 2) else total
ran = 0
while step < end:
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    step += 1
    ran += 1
    ck.maybe_save(step)
    if ran == 1 and after and rank == 0 and not (out / "stepping").exists():
        (out / "stepping").write_text(repr(time.time()))
    if run < kill_run and rank == 1 and ran == 30:
        os.kill(os.getpid(), signal.SIGKILL)
    # Steady: the 50th step of the run that is killed, or over a range of a later run of both
    # nodes (a late node taken in restarts the group: a run more).
    if (run == kill_run or (grow and run > kill_run and not after)) and rank == 0 and ran == 50 \
            and (not grow or dist.get_world_size() == 2) and not (out / "steady").exists():
        (out / "steady").write_text(repr(time.time()))
    if run == kill_run and rank == 1 and (out / "kill").exists():
        (out / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
ck.close()
dist.destroy_process_group()
