"""A training loop that fails inside step FAIL_AT, for the save-at-failure tests.

usage: fail_in_step.py CKPT_DIR MODE FAIL_AT

MODE:
  forward    an uncaught RuntimeError in the forward (the optimizer has not stepped)
  optimizer  an uncaught RuntimeError inside optimizer.step, after half the parameters moved
  caught     the forward's error caught by the script: ckpt.save_on_failure(e), then exit 3
  sigkill    SIGKILL to itself in the forward
No scheduled saves (every=1000): whatever checkpoint exists was saved at the failure.
"""

import os
import signal
import sys

import torch
from torch import nn

import rtrain

ckpt_dir, mode, fail_at = sys.argv[1], sys.argv[2], int(sys.argv[3])


class HalfStep(torch.optim.SGD):
    def step(self, closure=None):
        if mode != "optimizer" or step != fail_at:
            return super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].add_(1.0)  # one parameter moved, the rest not
        raise RuntimeError("failed half-way through the optimizer step")


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 2))
opt = HalfStep(model.parameters(), lr=0.1)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=1000)
start = ckpt.restore()
for step in range(start + 1, 20):
    x = torch.randn(4, 8)
    if step == fail_at and mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if step == fail_at and mode in ("forward", "caught"):
            raise RuntimeError(f"failed in the forward of step {step}")
    except RuntimeError as e:
        if mode != "caught":
            raise
        print(f"saved at the failure: {ckpt.save_on_failure(e)}", flush=True)
        sys.exit(3)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ckpt.maybe_save(step)
ckpt.close()
