"""A small training run on the GPU under rtrain.Checkpointer, for the GPU acceptance checks
(tests/test_gpu_real.py, scripts/gpu_check.sh).

usage: gpu_train.py CKPT_DIR STEPS [--oom-above B] [--pressure-above B --share F]
--oom-above: while the batch size (rtrain.settings) is above B, allocate 1 GiB blocks at step 3
until CUDA itself fails (a real torch.OutOfMemoryError, uncaught: the worker's exit record
says oom_gpu). --pressure-above: while above B, from step 3 hold ever more GPU memory until
the device's used share passes F, and keep training (rtrain's pressure watch must stop it).
"""

import argparse
import time

import torch
from torch import nn

import rtrain

p = argparse.ArgumentParser()
p.add_argument("ckpt_dir")
p.add_argument("steps", type=int)
p.add_argument("--oom-above", type=int)
p.add_argument("--pressure-above", type=int)
p.add_argument("--share", type=float, default=0.6)
args = p.parse_args()

s = rtrain.settings(batch_size=16, grad_accum=1)
dev = torch.device("cuda")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=args.ckpt_dir, every=5,
                           restoring=rtrain.Restoring(map_location="cuda"))
step = ckpt.restore()
held: list[torch.Tensor] = []
print(f"start step={step} batch_size={s.batch_size}", flush=True)
while step < args.steps:
    x = torch.randn(s.batch_size, 256, device=dev)
    y = torch.randint(0, 10, (s.batch_size,), device=dev)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if args.oom_above is not None and s.batch_size > args.oom_above and step == 3:
        while True:  # until the allocator itself fails: no exception of ours
            held.append(torch.empty(1 << 30, dtype=torch.uint8, device=dev))
    if args.pressure_above is not None and s.batch_size > args.pressure_above and step >= 3:
        free, total = torch.cuda.mem_get_info()
        if (total - free) / total < args.share:
            held.append(torch.empty(min(4 << 30, free // 2), dtype=torch.uint8, device=dev))
    ckpt.maybe_save(step, metrics={"loss": loss.item()})
    time.sleep(0.05)
ckpt.close()
print(f"done step={step}", flush=True)
