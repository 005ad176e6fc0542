"""Child of test_rank_membership.py: a two-rank gloo group in which rank 1 ends at once (as a
killed rank's sockets close) while rank 0 runs all-reduces; rank 0 prints, as JSON, whether
rtrain's worker reads the error it gets as a collective broken by a rank gone.

usage: peer_lost_probe.py RANK PORT
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from rtrain.worker import dist as rtrain_dist

rank, port = int(sys.argv[1]), sys.argv[2]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
if rank == 1:
    dist.barrier()
    os._exit(0)
dist.barrier()
try:
    for _ in range(100_000):
        dist.all_reduce(torch.ones(4))
except RuntimeError as e:
    print(json.dumps({"peer_lost": rtrain_dist.peer_lost(e), "error": str(e)[:300]}))
    os._exit(0)
print(json.dumps({"peer_lost": None, "error": "no error"}))
