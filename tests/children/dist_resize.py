"""Training at any world size with one effective batch, for the world-size change tests.

usage: dist_resize.py OUT_PREFIX TOTAL_STEPS EVERY [--fsdp] [--sleep S] [--until PATH]
One global ResumableSampler (its position counts samples of one global order, the same at any
world size) and a global batch of 8 samples per step: rank r of R takes its 8/R, in
micro-batches of 2, so fewer ranks accumulate more (accum = 8 / (2 R)); each micro-batch's loss
is scaled so that the averaged gradient is the global batch's mean, whatever R.
Rank 0 writes the gathered (full) model and optimizer state and the sampler position:
OUT_PREFIX-loaded.pt right after restore (when it resumed) and OUT_PREFIX-step<S>.pt after
every checkpointed step and after the last step.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, TensorDataset

import rtrain

GLOBAL, MICRO = 8, 2

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("total", type=int)
p.add_argument("every", type=int)
p.add_argument("--fsdp", action="store_true")
p.add_argument("--sleep", type=float, default=0.0)  # after each step: a node can be lost mid-run
p.add_argument("--until", default=None)  # no more sleeps once this file exists: a quick end
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert GLOBAL % (MICRO * world) == 0, world
accum = GLOBAL // (MICRO * world)

torch.manual_seed(1234)
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(64, 12, generator=g), torch.randint(0, 4, (64,), generator=g))
model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
if args.fsdp:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
else:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sampler = rtrain.ResumableSampler(len(ds), seed=7, shuffle=True)
loader = DataLoader(ds, batch_size=GLOBAL, sampler=sampler, drop_last=True)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, loader=sampler, every=args.every,
                           keep=5, restoring=rtrain.Restoring(allow_resize=True),
                           ckpt_dir=os.environ.get("RTRAIN_CKPT_DIR", "checkpoints"))


def dump(name: str, step: int) -> None:
    """The full state, gathered onto rank 0 (a collective: every rank calls it)."""
    msd, osd = get_state_dict(model, opt,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"model": msd, "optim": osd, "step": step, "world": world,
                    "position": sampler.state_dict()["position"],
                    "epoch": sampler.state_dict()["epoch"]}, f"{args.out}-{name}.pt")


step = ckpt.restore()
if step:
    dump("loaded", step)
while step < args.total:
    for x, y in loader:
        share = GLOBAL // world
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        opt.zero_grad()
        for i in range(accum):
            xm, ym = x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]
            # Sum over the micro-batch / the global batch, times R: DDP and FSDP average the
            # ranks' gradients, which makes it the global batch's mean.
            loss = nn.functional.cross_entropy(model(xm), ym, reduction="sum") * world / GLOBAL
            loss.backward()
        opt.step()
        step += 1
        if not (args.until and os.path.exists(args.until)):
            time.sleep(args.sleep)
        ckpt.maybe_save(step)
        if step % args.every == 0 or step == args.total:
            dump(f"step{step}", step)
        if step >= args.total:
            break
ckpt.close()
dist.barrier()
dist.destroy_process_group()
