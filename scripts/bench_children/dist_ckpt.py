"""Bench child, run under torchrun: time Checkpointer save and restore of a sharded (FSDP2)
model whose total size does not depend on the world size. Rank 0 prints one JSON line."""

import json
import os
import sys
import time

import torch.distributed as dist
from torch import nn

import rtrain

ckpt_dir, mib, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

width = 1024
layers = max(1, mib * 2**20 // (width * width * 4))
model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
ck = rtrain.Checkpointer(model=model, ckpt_dir=ckpt_dir, keep=1)
saves, loads = [], []
for i in range(repeats):
    dist.barrier()
    t = time.perf_counter()
    path = ck.save(i + 1)
    saves.append(time.perf_counter() - t)
    dist.barrier()
    t = time.perf_counter()
    ck.restore(path)
    loads.append(time.perf_counter() - t)
if rank == 0:
    nbytes = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(json.dumps({"world": world, "bytes": nbytes, "save_s": min(saves),
                      "restore_s": min(loads)}), flush=True)
dist.destroy_process_group()
os._exit(0)
