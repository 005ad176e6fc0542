"""A run that others try to speak for on its heartbeat channel (tests/test_heartbeat_forged.py).

usage: hb_target.py OUT MODE

Six disk saves that keep everything (keep=None), then a memory snapshot at every step (disk
saves far off: no `persist` request of its own). Its heartbeat address goes to OUT/address once
the snapshots have started. MODE "wait": it steps (a heartbeat each) until OUT/go appears,
then exits 0. MODE "hang": it stops sending anything and sleeps: a hang rtrain must find,
whatever others send meanwhile.
"""

import os
import sys
import time
from pathlib import Path

import torch

import rtrain

out, mode = Path(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, every=1000, keep=None,
                           saving=rtrain.Saving(memory=1))


def train(step: int) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    rtrain.heartbeat(step=step, loss=float(loss))


step = ckpt.restore() or 0
for _ in range(6):
    step += 1
    train(step)
    ckpt.save(step)
step += 1
train(step)
ckpt.maybe_save(step)  # the first snapshot in memory
tmp = out / "address.tmp"
tmp.write_text(os.environ["RTRAIN_HEARTBEAT"])
tmp.rename(out / "address")
if mode == "hang":
    while True:
        time.sleep(60)
while not (out / "go").exists():
    step += 1
    train(step)
    ckpt.maybe_save(step)
    time.sleep(0.05)
ckpt.close()
