"""A tiny training run saving with every="auto" and nothing else: no bounds; the memory tier
off, so that every resume is from the disk saves the cadence chose.

usage: auto_plain.py STEPS STEP_SLEEP LOG
Each finished step appends `{"a": attempt, "step": n}` to LOG, so a test can tell when an
attempt is training.
"""

import json
import os
import sys
import time

import torch

import rtrain

steps, step_sleep, log = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
attempt = int(os.environ.get("RTRAIN_ATTEMPT", "0"))
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ck = rtrain.Checkpointer(model=model, optimizer=opt, keep=2, every="auto",
                        saving=rtrain.Saving(memory=None))
with open(log, "a") as out:
    for step in range(ck.restore(), steps):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(step_sleep)
        ck.maybe_save(step + 1, metrics={"loss": loss.item()})
        out.write(json.dumps({"a": attempt, "step": step + 1}) + "\n")
        out.flush()
ck.close()
