"""Saves a ~24 MB state over and over until killed (for the kill-during-save tests).

usage: save_forever.py CKPT_DIR
"""

import sys

import torch
from torch import nn

import rtrain

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
opt = torch.optim.Adam(model.parameters())
ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=sys.argv[1], keep=2)
step = ck.restore()
print("ready", flush=True)
while True:
    step += 1
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))  # each checkpoint's content is checkable: every weight == step
    ck.save(step)
