"""A small training loop whose DataLoader has workers, for the data-position bitwise tests.

usage: train_data.py CKPT_DIR OUT TOTAL_STEPS DIE_AT [--workers W] [--persistent] [--pin]
       [--prefetch P] [--batch B] [--loader torch|stateful|none] [--data map|iterable|stream]
       [--aug sample|global] [--every N] [--log FILE] [--slow-worker S]

Exits abruptly (os._exit, no save) after step DIE_AT, like a killed process; DIE_AT=0 never.
`--loader none` is the sampler-only idiom (no loader= given to the Checkpointer). `--log` appends
"step index index ..." per step, the samples the step trained on.
`--data iterable` is an IterableDataset sharded by worker; `stream` the same with its own
state_dict()/load_state_dict(). `--slow-worker S`: the last worker's `worker_init_fn` sleeps S
seconds, as a worker descheduled on a loaded machine starts late.
"""

import argparse
import os
import random

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import rtrain

p = argparse.ArgumentParser()
p.add_argument("ckpt_dir")
p.add_argument("out")
p.add_argument("total", type=int)
p.add_argument("die_at", type=int)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--persistent", action="store_true")
p.add_argument("--pin", action="store_true")
p.add_argument("--prefetch", type=int, default=None)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--loader", default="torch", choices=["torch", "stateful", "none"])
p.add_argument("--data", default="map", choices=["map", "iterable", "stream"])
p.add_argument("--aug", default="sample", choices=["sample", "global", "none"])
p.add_argument("--every", type=int, default=3)
p.add_argument("--log", default=None)
p.add_argument("--slow-worker", type=float, default=0)
args = p.parse_args()

N = 44
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(N, 16, generator=g), torch.randint(0, 4, (N,), generator=g)


def augment(x, i):
    if args.aug == "sample":  # the documented idiom: exact after any resume
        return x + 0.1 * torch.randn(16, generator=rtrain.sample_generator(i))
    if args.aug == "global":  # the worker's own generator: not reproducible mid-epoch
        return x + 0.1 * torch.randn(16)
    return x


class Items(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return augment(X[i], i), Y[i], int(i)


class Stream(IterableDataset):
    """Items 0..N-1 in order, worker w of W taking every W-th; `stream` keeps its position."""

    def __init__(self, own_state):
        self.pos, self.own_state = 0, own_state

    def __iter__(self):
        info = get_worker_info()
        w, n_workers = (info.id, info.num_workers) if info else (0, 1)
        start, self.pos = self.pos or w, 0  # pos: this copy's next index (0: a fresh epoch)
        for i in range(start, N, n_workers):
            self.pos = i + n_workers
            yield X[i], Y[i], i
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


if args.data != "stream":
    del Stream.state_dict, Stream.load_state_dict

torch.manual_seed(1234)
random.seed(1234)
np.random.seed(1234)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
kw = dict(batch_size=args.batch, num_workers=args.workers, pin_memory=args.pin,
          persistent_workers=args.persistent)
if args.prefetch is not None:
    kw["prefetch_factor"] = args.prefetch
if args.slow_worker:
    import time

    def slow_start(worker_id):
        if worker_id == args.workers - 1:
            time.sleep(args.slow_worker)

    kw["worker_init_fn"] = slow_start
sampler = None
if args.data == "map":
    sampler = rtrain.ResumableSampler(N, seed=7, shuffle=True)
    ds = Items()
else:
    ds = Stream(own_state=args.data == "stream")
if args.loader == "stateful":
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = StatefulDataLoader(ds, sampler=sampler, **kw)
else:
    loader = DataLoader(ds, sampler=sampler, **kw)
# --loader none: the bare sampler, the idiom exact only without loader workers
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, ckpt_dir=args.ckpt_dir,
                           every=args.every, keep=2,
                           loader=loader if args.loader != "none" else sampler)
step = ckpt.restore()
log = open(args.log, "a") if args.log else None  # noqa: SIM115
while step < args.total:
    for x, y, idx in loader:
        noise = 1e-3 * (random.random() + float(np.random.rand()))
        loss = nn.functional.cross_entropy(model(x + noise), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if log:
            log.write(f"{step} {' '.join(map(str, idx.tolist()))}\n")
            log.flush()
        ckpt.maybe_save(step, metrics={"loss": loss.item()})
        if step == args.die_at:
            os._exit(9)
        if step >= args.total:
            break
ckpt.close()
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, args.out)
