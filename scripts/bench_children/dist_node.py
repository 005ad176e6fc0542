"""Bench child, one rank per node under `rtrain launch --nnodes`: DDP steps of ~20 ms. Each
process notes when it started (after torchrun's rendezvous: workers start only then) and, when
it resumed, when its first step after the restore ended (a DDP step needs every rank: the group
is stepping again). Times go to OUT_DIR/<node>-<attempt>-{start,stepping}."""

import time

STARTED = time.time()  # before the imports: what is left is the interpreter's own start

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import rtrain  # noqa: E402

out, node, total = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tag = f"{node}-{os.environ.get('RTRAIN_ATTEMPT', '0')}"
(out / f"{tag}-start").write_text(repr(STARTED))
dist.init_process_group("gloo")
world = dist.get_world_size()
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ck = rtrain.Checkpointer(model=model, optimizer=opt, every=10, keep=2,
                         restoring=rtrain.Restoring(allow_resize=True))
step = resumed = ck.restore()
while step < total:
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    step += 1
    ck.maybe_save(step)
    if resumed and step == resumed + 1:
        (out / f"{tag}-stepping").write_text(repr(time.time()))
ck.close()
dist.destroy_process_group()
