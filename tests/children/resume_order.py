"""A tiny GPT-style loop for `rtrain check-resume`: batches drawn from torch's RNG (like
nanoGPT's get_batch), dropout, AdamW, rtrain.Checkpointer.

usage: resume_order.py [--steps N] [--prefetch] [--reseed]
--prefetch draws the next batch after optimizer.step(), before maybe_save(): the order that
loses a batch on resume. --reseed seeds torch after ckpt.restore(), as a script that seeds on
every start does: the restored RNG state (dropout masks, batches) is replaced.
"""

import argparse

import torch
from torch import nn

import rtrain

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--prefetch", action="store_true")
p.add_argument("--reseed", action="store_true")
args = p.parse_args()

torch.manual_seed(0)
data = torch.randn(256, 8)


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.randint(0, len(data), (8,))
    return data[i], data[i].sum(1, keepdim=True)


model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, every=5)
step = ckpt.restore()
if args.reseed:
    torch.manual_seed(1337)
if args.prefetch:
    x, y = get_batch()
while step < args.steps:
    if not args.prefetch:
        x, y = get_batch()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.prefetch:
        x, y = get_batch()  # the next step's batch, drawn before the save
    step += 1
    ckpt.maybe_save(step, metrics={"loss": loss.item()})
ckpt.close()
