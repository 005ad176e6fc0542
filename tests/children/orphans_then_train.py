"""Leave orphans behind, then train with a Checkpointer until stopped.

usage: orphans_then_train.py CKPT_DIR STEPS ORPHANS
First ORPHANS processes are double-forked: each one's parent exits at once, so the orphan is
re-parented to the nearest subreaper (rtrain) or to PID 1, and exits 0.2 s later: a zombie until
that new parent waits for it. One more orphan sleeps on (rtrain's sweep ends it). Then STEPS
steps of a tiny model, 0.1 s each, printing `step N`, a checkpoint every 5 steps and on a stop.
"""

import os
import sys
import time


def orphan(seconds: float) -> None:
    pid = os.fork()
    if pid == 0:
        if os.fork() == 0:
            time.sleep(seconds)
        os._exit(0)  # the middle process: its child is now an orphan
    os.waitpid(pid, 0)


ckpt_dir, steps, orphans = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for _ in range(orphans):
    orphan(0.2)
orphan(600)
print(f"left {orphans + 1} orphans", flush=True)

import torch  # noqa: E402 - after the forks: none of them carries torch's threads

import rtrain  # noqa: E402

model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, every=5)
for step in range(ckpt.restore() + 1, steps + 1):
    opt.zero_grad()
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    print(f"step {step}", flush=True)
    time.sleep(0.1)
    ckpt.maybe_save(step)
ckpt.close()
