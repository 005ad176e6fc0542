"""A tiny training run saving with every_steps="auto" (crashes come from RTRAIN_FAULTS).

usage: auto_cadence.py STEPS
`total_steps=STEPS` sets the first interval (STEPS / 20); each save then chooses the next from
its stall, the step time and the run's failures that rtrain passes in.
"""

import sys
import time

import torch

import worker

steps = int(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = worker.Checkpointer(model=model, optimizer=opt, keep=2,
                         every=worker.Every(steps="auto", total_steps=steps))
for step in range(ck.restore(), steps):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.01)  # a step time the save stall is small against, as in real training
    ck.maybe_save(step + 1)
ck.close()
