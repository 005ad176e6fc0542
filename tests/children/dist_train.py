"""A 2-rank (gloo, CPU) training loop the way people write one, for the distributed tests.

usage: dist_train.py OUT_PREFIX TOTAL_STEPS [--fsdp] [--every N] [--die-at S --die-rank R]
                     [--workers W] [--step-sleep S] [--slow-rank R --slow-sleep S]
                     [--jitter J] [--scripted-flight-recorder] [--memory N]
Writes OUT_PREFIX-rank<R>.pt (the rank's local model/optimizer state and RNG) at the end.
--die-at: in attempt 0, rank R writes an exit record and SIGKILLs itself after step S.
--workers: each rank loads its share through a DistributedResumableSampler and a DataLoader with
W worker processes handed to the Checkpointer (default: one global loader, sliced per rank).
--step-sleep (or --sleep): sleep S seconds per step (a run long enough to be stopped from outside,
or to lose a node mid-run), and append each executed step to OUT_PREFIX-rank<R>.steps (what a
stop test counts lost steps with).
--slow-rank/--slow-sleep: rank R sleeps S seconds per step instead (a straggler), after its
optimizer step, so the others wait for it at the step boundary. --jitter J: each sleep varies by
up to +-J of itself, at random per step (ranks that differ by noise). --sleep-in-step: these
sleeps come between the forward and the backward instead (compute: the others wait for a slow rank
inside DDP's gradient all-reduce).
--scripted-flight-recorder: each rank serves an NCCL flight recorder dump pipe as PyTorch does
on a GPU (TORCH_NCCL_DEBUG_INFO_PIPE_FILE, TORCH_NCCL_DEBUG_INFO_TEMP_FILE).
--memory N: the memory tier, a snapshot every N steps (each rank its part).
RTRAIN_FAULTS=hang_forward@step=N,rank=R hangs rank R inside its forward of step N.
"""

import argparse
import os
import random
import signal
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rtrain
from rtrain.worker.guards import faults

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("total", type=int)
p.add_argument("--fsdp", action="store_true")
p.add_argument("--every", type=int, default=3)
p.add_argument("--die-at", type=int, default=0)
p.add_argument("--die-rank", type=int, default=1)
p.add_argument("--width", type=int, default=32)
p.add_argument("--workers", type=int, default=-1)
p.add_argument("--step-sleep", "--sleep", dest="step_sleep", type=float, default=0.0)
p.add_argument("--slow-rank", type=int, default=-1)
p.add_argument("--slow-sleep", type=float, default=0.0)
p.add_argument("--jitter", type=float, default=0.0)
p.add_argument("--sleep-in-step", action="store_true")
p.add_argument("--scripted-flight-recorder", action="store_true")
p.add_argument("--memory", type=int, default=0)
args = p.parse_args()


def scripted_flight_recorder(rank):
    """What ProcessGroupNCCL's monitor does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE (gloo has no
    flight recorder): read `<pipe prefix><rank>.pipe`; on a write, dump the trace to
    `<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>`."""
    pipe = os.environ["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] + f"{rank}.pipe"
    os.mkfifo(pipe)

    def serve():
        with open(pipe, "rb") as f:
            if f.read(1):
                with open(os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] + str(rank), "wb") as out:
                    out.write(f"scripted trace of rank {rank}".encode())

    threading.Thread(target=serve, daemon=True).start()


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.scripted_flight_recorder:
    scripted_flight_recorder(rank)
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
pause = args.slow_sleep if rank == args.slow_rank else args.step_sleep
jitter = random.Random(f"jitter-{rank}")  # apart from the training's own generators

torch.manual_seed(1234)  # the same initial weights on every rank
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(48, 16, generator=g), torch.randint(0, 4, (48,), generator=g))
model = nn.Sequential(nn.Linear(16, args.width), nn.ReLU(), nn.Dropout(0.3),
                      nn.Linear(args.width, 4))
if args.fsdp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
else:
    model = nn.parallel.DistributedDataParallel(model)
# Each rank its own RNG streams (dropout, augmentation): what per-rank RNG state must restore.
torch.manual_seed(1000 + rank)
random.seed(rank)
np.random.seed(rank)


def forward_hook(module, inputs):
    # RTRAIN_FAULTS=hang_forward@step=N,rank=R hangs this rank here, inside its forward.
    faults.in_step(step=step + 1)


model.register_forward_pre_hook(forward_hook)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
if args.workers < 0:
    sampler = rtrain.ResumableSampler(len(ds), seed=7, shuffle=True)
    loader = DataLoader(ds, batch_size=4 * world, sampler=sampler)  # global batch; rank's slice
    tracked = sampler
else:
    sampler = rtrain.DistributedResumableSampler(len(ds), seed=7, shuffle=True)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=args.workers)
    tracked = loader
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=tracked,
                           every=args.every, keep=2,
                           saving=rtrain.Saving(memory=args.memory or None),
                           ckpt_dir=os.environ.get("RTRAIN_CKPT_DIR", "checkpoints"))
step = ckpt.restore()
while step < args.total:
    for x, y in loader:
        if args.workers < 0:
            x, y = x[rank::world], y[rank::world]
        noise = 1e-3 * (random.random() + float(np.random.rand()))
        loss = nn.functional.cross_entropy(model(x + noise), y)
        if pause and args.sleep_in_step:
            time.sleep(pause * (1 + args.jitter * jitter.uniform(-1, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if pause:
            with open(f"{args.out}-rank{rank}.steps", "a") as f:
                f.write(f"{attempt} {step}\n")
        if pause and not args.sleep_in_step:
            time.sleep(pause * (1 + args.jitter * jitter.uniform(-1, 1)))
        ckpt.maybe_save(step, metrics={"loss": loss.item()})
        if step == args.die_at and rank == args.die_rank and attempt == 0:
            rtrain.write_exit_record("crash", f"injected kill of rank {rank}", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= args.total:
            break
ckpt.close()


def local(x):
    if hasattr(x, "to_local"):
        return x.to_local()
    if isinstance(x, dict):
        return {k: local(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(local(v) for v in x)
    return x


torch.save({"model": local(model.state_dict()), "opt": local(opt.state_dict()), "step": step,
            "rng": torch.get_rng_state(), "py": random.random(), "np": float(np.random.rand())},
           f"{args.out}-rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
