"""A small real training loop written the way people write it, for the bitwise-resume tests.

usage: train_bitwise.py CKPT_DIR OUT TOTAL_STEPS DIE_AT [--async] [--every N] [--memory N]
Exits abruptly (os._exit, no save) after step DIE_AT, like a killed process; DIE_AT=0 never.
--memory -2 leaves `memory=` out (the default tier); without --memory the tier is off.
"""

import argparse
import os
import random
import time

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rtrain

p = argparse.ArgumentParser()
p.add_argument("ckpt_dir")
p.add_argument("out")
p.add_argument("total", type=int)
p.add_argument("die_at", type=int)
p.add_argument("--async", dest="async_save", action="store_true")
p.add_argument("--every", type=int, default=3)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--memory", type=int, default=None,
               help="the memory tier: a snapshot every N; -2: `memory=` left out (the default)")
p.add_argument("--die-once", action="store_true", help="die at DIE_AT in attempt 0 only")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step also takes")
args = p.parse_args()

torch.manual_seed(1234)
random.seed(1234)
np.random.seed(1234)
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(44, 16, generator=g), torch.randint(0, 4, (44,), generator=g))
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
sampler = rtrain.ResumableSampler(len(ds), seed=7, shuffle=True)
loader = DataLoader(ds, batch_size=args.batch, sampler=sampler)
mode = "auto" if args.async_save else "off"
saving = (rtrain.Saving(async_mode=mode) if args.memory == -2
          else rtrain.Saving(async_mode=mode, memory=args.memory))
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=sampler,
                           ckpt_dir=args.ckpt_dir, every=args.every, keep=2, saving=saving)
step = ckpt.restore()
while step < args.total:
    for x, y in loader:
        # python and numpy RNG in play too, as augmentation code would use them
        noise = 1e-3 * (random.random() + float(np.random.rand()))
        loss = nn.functional.cross_entropy(model(x + noise), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.maybe_save(step, metrics={"loss": loss.item()})
        if step == args.die_at and not (args.die_once and os.environ.get("RTRAIN_ATTEMPT", "0")
                                        != "0"):
            os._exit(9)
        if step >= args.total:
            break
ckpt.close()
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, args.out)
