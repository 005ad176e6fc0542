"""A small torch run through the Checkpointer that keeps its own log, to check what rtrain says
a failure cost against what the script saw.

usage: recovery_train.py STEPS OUT [STEP_SLEEP_S]
Appends JSON lines to OUT: {"attempt", "resumed", "time"} after restore(), {"attempt", "step",
"time"} after each step's maybe_save, and {"attempt", "crash", "time"} when maybe_save raises
(an RTRAIN_FAULTS crash) before the exception ends the process. Saves every 5 steps.
"""

import json
import os
import sys
import time

import torch

import rtrain

steps, out = int(sys.argv[1]), sys.argv[2]
pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.05
attempt = os.environ.get("RTRAIN_ATTEMPT")
rtrain.install_excepthook()  # the exit record: the failure's time, by this process's clock


def log(**fields):
    with open(out, "a") as f:
        f.write(json.dumps({"attempt": attempt, **fields, "time": time.time()}) + "\n")


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# The disk tier alone (the memory tier, on by default, would keep step 12: no step to lose).
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=5, keep=None,
                         saving=rtrain.Saving(memory=None))
start = ck.restore()
log(resumed=start)
for step in range(start, steps):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(pause)  # a step long enough for its time to be measured
    try:
        ck.maybe_save(step + 1, metrics={"loss": loss.item()})
    except RuntimeError:
        log(crash=step + 1)
        raise
    log(step=step + 1)
ck.close()
