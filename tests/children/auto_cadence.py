"""A tiny training run saving with every="auto" (crashes come from RTRAIN_FAULTS).

usage: auto_cadence.py STEPS
The first save comes at step 2, to measure one; each save then chooses the next interval from
its stall, the step time and the run's failures that rtrain passes in.
"""

import sys
import time

import torch

import rtrain

steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = rtrain.Checkpointer(model=model, optimizer=opt, keep=2, every="auto")
for step in range(ck.restore(), steps):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.01)  # a step time the save stall is small against, as in real training
    ck.maybe_save(step + 1)
ck.close()
