"""A tiny Checkpointer loop for fault-injection tests: saves every step, prints each step.

usage: checkpointer_every_step.py CKPT_DIR STEPS [sync|fork]
"""

import sys

import torch

import rtrain

ckpt_dir, steps = sys.argv[1], int(sys.argv[2])
mode = sys.argv[3] if len(sys.argv) > 3 else "sync"
model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=1, keep=None,
                           saving=rtrain.Saving(async_mode="off" if mode == "sync" else "fork"))
for step in range(ckpt.restore() + 1, steps + 1):
    opt.zero_grad()
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    print(f"step {step}", flush=True)
    ckpt.maybe_save(step)
ckpt.close()
