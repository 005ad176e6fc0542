"""Train on the GPU, crash once (after 8 s, when rtrain's warm standby is ready), resume.

usage: gpu_crash_once.py CKPT_DIR MARKER    (MARKER: created at the crash; none: crash)
"""

import os
import sys
import time

import torch

import rtrain

ckpt_dir, marker = sys.argv[1:3]
model = torch.nn.Linear(64, 64).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=10,
                           restoring=rtrain.Restoring(map_location="cuda"))
step = ckpt.restore()
began = time.monotonic()
while step < 200:
    model(torch.randn(8, 64, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    ckpt.maybe_save(step)
    if not os.path.exists(marker) and time.monotonic() - began > 8 and step % 10 == 1:
        open(marker, "w").close()
        raise RuntimeError("injected crash")
    time.sleep(0.05)
ckpt.close()
