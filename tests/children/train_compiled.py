"""A small model under torch.compile, trained with rtrain.Checkpointer: the compile-cache tests
and scripts/bench_compile_restart.py.

usage: train_compiled.py CKPT_DIR OUT TOTAL [--die-at N] [--every N] [--no-cache] [--trust]
                         [--marks FILE] [--arm FILE] [--stop-after-resume]
Writes OUT (JSON: step, inductor's cache counters, the final weights' file) and OUT.pt (the
final model and optimizer state). --die-at: os._exit(9) after that step's save, like a kill.
--marks: append "resumed <unix time> <step>" at the first step after a restore, and "crash ..."
before it raises once the file --arm names appears (once: it creates ARM.crashed first).
--stop-after-resume: end after that first resumed step (the benchmark's measure is taken).
"""

import argparse
import json
import os
import time

import torch
from torch import nn

import rtrain

p = argparse.ArgumentParser()
p.add_argument("ckpt_dir")
p.add_argument("out")
p.add_argument("total", type=int)
p.add_argument("--die-at", type=int, default=0)
p.add_argument("--every", type=int, default=2)
p.add_argument("--width", type=int, default=16)
p.add_argument("--layers", type=int, default=1)
p.add_argument("--no-cache", action="store_true", help="Saving(compile_cache=False)")
p.add_argument("--trust", action="store_true", help="Restoring(allow_pickle=True)")
p.add_argument("--marks")
p.add_argument("--arm")
p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (waiting on data)")
p.add_argument("--stop-after-resume", action="store_true")
args = p.parse_args()

torch.manual_seed(1234)
layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
model = nn.Sequential(*layers, nn.Linear(args.width, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
compiled = torch.compile(model)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=args.ckpt_dir, every=args.every,
                           keep=2, saving=rtrain.Saving(compile_cache=not args.no_cache),
                           restoring=rtrain.Restoring(allow_pickle=args.trust))
step = ckpt.restore()
resumed = step > 0


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)  # the data of step i, whichever process runs it
    return torch.randn(8, args.width, generator=g), torch.randint(0, 4, (8,), generator=g)


def mark(what: str) -> None:
    if args.marks:
        with open(args.marks, "a") as f:
            f.write(f"{what} {time.time()!r} {step}\n")


while step < args.total:
    x, y = batch(step)
    loss = nn.functional.cross_entropy(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if resumed:
        resumed = False
        mark("resumed")
        if args.stop_after_resume:
            break
    ckpt.maybe_save(step, metrics={"loss": loss.item()})
    if step == args.die_at:
        os._exit(9)
    if (args.arm and step > args.every and os.path.exists(args.arm)
            and not os.path.exists(args.arm + ".crashed")):
        open(args.arm + ".crashed", "w").close()
        mark("crash")
        raise RuntimeError("injected crash")
    time.sleep(args.sleep)
ckpt.close()
from torch._dynamo.utils import counters  # noqa: E402  (after the run: what the compiles hit)

torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.out + ".pt")
with open(args.out, "w") as f:
    json.dump({"step": step, "inductor": dict(counters["inductor"])}, f)
