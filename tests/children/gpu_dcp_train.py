"""Two ranks under torchrun on two GPUs over NCCL, the model sharded with FSDP2 and saved
through torch.distributed.checkpoint (Saving(sharded=True)); rank 1 crashes once at step 5.

usage: gpu_dcp_train.py CKPT_DIR MARKER STEPS
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import rtrain

ckpt_dir, marker, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(),
                            torch.nn.Linear(128, 8)).cuda()
fully_shard(model, mesh=init_device_mesh("cuda", (world,)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=2,
                           saving=rtrain.Saving(sharded=True),
                           restoring=rtrain.Restoring(map_location="cuda"))
step = ckpt.restore()
while step < steps:
    torch.manual_seed(step)
    model(torch.randn(16, 128, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()
    step += 1
    ckpt.maybe_save(step)
    if step == 5 and rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("injected crash on rank 1")
ckpt.close()
dist.destroy_process_group()
