"""A small deterministic training run for the end-to-end fault tests and scripts/chaos.py.

usage: chaos_train.py OUT_DIR

Knobs (rtrain.settings, i.e. RTRAIN_SETTINGS): batch_size, grad_accum, steps, save_every (0:
every="auto", the cadence chosen from the save cost and the run's failures), lr,
samples, keep, workers (DataLoader worker processes; the loader is then handed to the
Checkpointer), mem_mb (MiB of host memory touched per sample of a micro-batch, so memory use
scales with batch_size), step_sleep (seconds per step, after the optimizer's step),
forward_sleep (seconds per micro-batch, after its forward: the state untouched),
optimizer_sleep (seconds inside each optimizer step, before it changes anything), fill_at /
unfill_at / fill_path (fill the filesystem holding fill_path at that step, delete the filler at
that step), memory (the memory tier: a snapshot every N steps; 0 off, -1 "auto", -2 `memory=`
left out: the default),
width (0: the small model; N: three hidden layers of N, the issue's MLP at 2048).

Writes to OUT_DIR:
  steps.jsonl  one line per executed step, flushed before the step's maybe_save:
               {"a": attempt, "pid", "step", "t": unix time, "first": global index of the
               step's first sample, "ids": [sample ids in order], "bs", "accum"}
               and one line per start: {"a", "pid", "start": step, "resume_from": path or null,
               "verified_full": whether that checkpoint verified at `full` just before loading}
  final.pt     torch.save({"model", "opt", "step"}) after the last step

`samples` is divisible by every batch size, so sample k of the run (k = global index) is
position k % samples of epoch k // samples.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import rtrain
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.protocol import ENV_RESUME_FROM
from rtrain.worker import runtime
from rtrain.worker.guards import faults

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
s = rtrain.settings(batch_size=8, grad_accum=1, steps=120, save_every=4, lr=0.01, samples=64,
                    keep=3, workers=0, mem_mb=0, step_sleep=0.0, forward_sleep=0.0,
                    optimizer_sleep=0.0, fill_at=0, unfill_at=0, fill_path="", memory=0, width=0)
rtrain.install_excepthook()
attempt = runtime.attempt()
log = open(out / "steps.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the whole run


def record(**fields) -> None:
    log.write(json.dumps({"a": attempt, "pid": os.getpid(), **fields}) + "\n")


def fill(path: Path) -> None:
    """Fill the filesystem holding `path` until it refuses (ENOSPC)."""
    chunk = b"\0" * (1 << 16)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    print(f"filled the disk at {path}", flush=True)


torch.manual_seed(1234)
random.seed(1234)
np.random.seed(1234)
g = torch.Generator().manual_seed(0)
ds = TensorDataset(torch.randn(s.samples, 16, generator=g),
                   torch.randint(0, 4, (s.samples,), generator=g), torch.arange(s.samples))
if s.width:
    w = s.width
    model = nn.Sequential(nn.Linear(16, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, w), nn.ReLU(), nn.Dropout(0.2), nn.Linear(w, 4))
else:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=25, gamma=0.8)
sampler = rtrain.ResumableSampler(len(ds), seed=7, shuffle=True)
loader = DataLoader(ds, batch_size=s.batch_size, sampler=sampler, num_workers=s.workers)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched,
                           loader=loader if s.workers else sampler, keep=s.keep,
                           every=s.save_every or "auto",
                           saving=rtrain.Saving() if s.memory == -2 else rtrain.Saving(
                               memory={0: None, -1: "auto"}.get(s.memory, s.memory)))
if s.optimizer_sleep:  # after the Checkpointer's own pre-hook: inside optimizer.step()
    opt.register_step_pre_hook(lambda *_: time.sleep(s.optimizer_sleep))
resume_from = os.environ.get(ENV_RESUME_FROM)
ok = verify(resume_from, Level.FULL).ok if resume_from else None
start = ckpt.restore()
# The lr knob wins over the checkpoint's (the supervisor cuts it after a non-finite loss).
for group in opt.param_groups:
    if group["initial_lr"] != s.lr:  # untouched otherwise: (a * b) / a need not be b
        group["lr"] = s.lr * group["lr"] / group["initial_lr"]
        group["initial_lr"] = s.lr
sched.base_lrs = [s.lr] * len(opt.param_groups)
record(start=start, resume_from=resume_from, verified_full=ok, settings=dict(s))
print(f"attempt {attempt}: start at step {start} from {resume_from}", flush=True)


def batches():
    while True:  # the sampler rolls the epoch over by itself
        yield from loader


guard = rtrain.NonFiniteGuard(max_consecutive=5)
it = batches()
for step in range(start + 1, s.steps + 1):
    ids: list[int] = []
    first = None
    total = 0.0
    for _ in range(s.grad_accum):
        x, y, idx = next(it)
        if first is None:
            first = ckpt.data.samples_seen - len(idx)  # consumed, not prefetched
        ids += idx.tolist()
        if s.mem_mb:  # activations that grow with the micro-batch
            activations = torch.ones(len(idx) * s.mem_mb << 20, dtype=torch.uint8)
            del activations
        noise = 1e-3 * (random.random() + float(np.random.rand()))
        logits = model(x + noise)  # the batch, the RNG draws and dropout are spent before a fault
        faults.in_step(step=step, batch_size=len(idx))
        if s.forward_sleep:  # a forward that waits (on a device, on data): state untouched
            time.sleep(s.forward_sleep)
        loss = nn.functional.cross_entropy(logits, y) / s.grad_accum
        loss = faults.poison_loss(loss, step)
        loss.backward()
        total += loss.item()
    if not guard.skip(torch.tensor(total), model=model, step=step):
        opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    if s.step_sleep:
        time.sleep(s.step_sleep)
    record(step=step, t=time.time(), first=first, ids=ids, bs=s.batch_size, accum=s.grad_accum)
    if s.fill_at and step == s.fill_at and not Path(s.fill_path).exists():
        fill(Path(s.fill_path))
    if s.unfill_at and step == s.unfill_at and Path(s.fill_path).exists():
        os.remove(s.fill_path)
        print(f"freed the disk at step {step}", flush=True)
    ckpt.maybe_save(step, metrics={"loss": total})
if start < s.steps:
    ckpt.save(s.steps)
ckpt.close()
tmp = out / f".final.pt.{os.getpid()}"
torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s.steps}, tmp)
os.replace(tmp, out / "final.pt")
print(f"attempt {attempt}: done, {s.steps} steps, {ckpt.skipped_saves} saves skipped", flush=True)
