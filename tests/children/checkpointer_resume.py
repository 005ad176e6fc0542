"""A tiny torch training run through the Checkpointer: checkpoints every 2 steps.

usage: checkpointer_resume.py STEPS OUT [--swap SRC DST]
Prints {"resumed": step} after restore() and appends it to OUT (one JSON line per attempt).
--swap: at attempt 0, copy SRC over DST just before restore() (a file replaced after the
supervisor verified the checkpoint).
"""

import json
import os
import shutil
import sys

import torch

import rtrain

steps, out = int(sys.argv[1]), sys.argv[2]
if "--swap" in sys.argv and os.environ.get("RTRAIN_ATTEMPT") == "0":
    i = sys.argv.index("--swap")
    shutil.copyfile(sys.argv[i + 1], sys.argv[i + 2])

torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=2, keep=None)
start = ck.restore()
print(json.dumps({"resumed": start}), flush=True)
with open(out, "a") as f:
    f.write(json.dumps({"resumed": start, "attempt": os.environ.get("RTRAIN_ATTEMPT")}) + "\n")
for step in range(start, steps):
    loss = model(torch.randn(3, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    ck.maybe_save(step + 1, metrics={"loss": loss.item()})
ck.close()
