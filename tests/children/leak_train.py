"""A training loop whose host memory grows every step: it keeps a cache of `batch_size x
grow_kb` KiB per step (touched), as a script that caches activations or samples would.

usage: leak_train.py OUT_DIR

Knobs (rtrain.settings): batch_size, grad_accum, steps, grow_kb, step_sleep, save_every,
free_on_relieve: whether a relieve request (memory pressure) drops the cache
(`rtrain.on_pressure(...)`), or frees nothing, and fill_to: before training, hold memory (not
part of the cache) until the memory cgroup the script runs in has this share of its limit in
its working set (0: none), the level a run's memory then grows from or stays at; with it,
each step's line has "share": the group's working set / its limit.

Writes OUT_DIR/steps.jsonl: {"a": attempt, "step", "bs", "accum"} per executed step (flushed
before the step's maybe_save) and {"a", "start": step, "settings"} per start.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import rtrain
from rtrain.supervisor.proc.cgroup import memory_cgroup
from rtrain.worker import runtime

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
s = rtrain.settings(batch_size=16, grad_accum=1, steps=200, grow_kb=256, step_sleep=0.05,
                    save_every=50, free_on_relieve=False, fill_to=0.0, memory=0)
attempt = runtime.attempt()
log = open(out / "steps.jsonl", "a", buffering=1)  # noqa: SIM115 - open for the whole run
cache: list[bytearray] = []


def on_pressure() -> str | None:
    if not s.free_on_relieve:
        return None
    freed = sum(len(c) for c in cache)
    cache.clear()
    return f"cache of {freed >> 20} MiB dropped"


torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rtrain.on_pressure(on_pressure)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, every=s.save_every, keep=2,
                           saving=rtrain.Saving() if s.memory == -2  # `memory=` left out
                           else rtrain.Saving(memory=s.memory or None))
start = ckpt.restore()
held: list[bytearray] = []
group = memory_cgroup(os.getpid()) if s.fill_to else None
limit = group.limit() if group is not None else None
if s.fill_to:
    assert group is not None and limit is not None, "fill_to needs a memory cgroup limit"
    while (group.working_set() or 0) < s.fill_to * limit:
        held.append(bytearray(1 << 20))
log.write(json.dumps({"a": attempt, "start": start, "settings": dict(s)}) + "\n")
print(f"attempt {attempt}: start at step {start}, batch_size {s.batch_size}", flush=True)
for step in range(start + 1, s.steps + 1):
    for _ in range(s.grad_accum):
        x = torch.randn(s.batch_size, 16)
        (model(x).square().mean() / s.grad_accum).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    cache.append(bytearray(s.batch_size * s.grow_kb << 10))  # zero-filled: every page touched
    time.sleep(s.step_sleep)
    line = {"a": attempt, "step": step, "bs": s.batch_size, "accum": s.grad_accum}
    if group is not None and limit:
        line["share"] = round((group.working_set() or 0) / limit, 4)
    log.write(json.dumps(line) + "\n")
    ckpt.maybe_save(step)
if start < s.steps:
    ckpt.save(s.steps)
ckpt.close()
print(f"attempt {attempt}: done at step {s.steps}", flush=True)
