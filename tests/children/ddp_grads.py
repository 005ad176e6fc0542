"""Under torchrun (gloo): the gradients of one DDP model with DDP's built-in reduction and of the
same model under rtrain's timed comm hook (worker/commwait.py), three backwards each, compared
bit for bit. Prints `rank R: equal` or `rank R: differ by D`, and exits 0 either way."""

import os

import torch
import torch.distributed as dist
from torch import nn

from rtrain.worker.commwait import install

dist.init_process_group("gloo")
rank = dist.get_rank()


def grads(timed: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)))
    if timed:
        assert install(model) is not None
    out = []
    for i in range(3):
        torch.manual_seed(100 + 10 * rank + i)  # each rank its own batch
        model.zero_grad()
        model(torch.randn(8, 64)).pow(2).sum().backward()
        out += [p.grad.clone() for p in model.parameters()]
    return out


plain, timed = grads(False), grads(True)
diff = max((a - b).abs().max().item() for a, b in zip(plain, timed, strict=True))
same = all(torch.equal(a, b) for a, b in zip(plain, timed, strict=True))
print(f"rank {rank}: equal" if same else f"rank {rank}: differ by {diff:.3g}", flush=True)
dist.barrier()  # no rank leaves while another still talks to it
# Leave without torch's teardown: tearing gloo down with two DDP reducers still alive has
# aborted a rank at exit now and then ("terminate called without an active exception"), after
# the gradients were compared, which is all this program checks.
os._exit(0)
