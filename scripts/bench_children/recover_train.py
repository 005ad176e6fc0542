"""The recovery benchmark's training script: imports torch, builds a model, restores the
checkpoint if there is one, trains; crashes once, at the first step after the file argv[3]
appears, and records its start, the crash and the first step after a restore in argv[2]. While
the file `hold` is in argv[1], a restored attempt trains on (the benchmark kills it from
outside, soon after its relaunch) instead of ending at its first step."""

import os
import sys
import time

with open(sys.argv[2], "a") as f:  # before the imports: where the attempt's process begins
    f.write(f"start {time.time()!r} {os.getpid()}\n")

import torch

out_dir, marks, arm = sys.argv[1:4]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU())
                              for _ in range(4)], torch.nn.Linear(1024, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ckpt = os.path.join(out_dir, "ckpt.pt")
crashed = os.path.join(out_dir, "crashed")
step = 0
restored = os.path.exists(ckpt)
if restored:
    state = torch.load(ckpt)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
while True:
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if restored:
        with open(marks, "a") as f:
            f.write(f"resumed {time.time()!r} {step}\n")
        if not os.path.exists(os.path.join(out_dir, "hold")):
            break  # the measure is taken: the rest of the run is the same for every launcher
        restored = False
    if step % 10 == 0:
        tmp = ckpt + ".tmp"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
        os.replace(tmp, ckpt)
    if step % 10 == 1 and os.path.exists(arm) and not os.path.exists(crashed):
        open(crashed, "w").close()
        with open(marks, "a") as f:
            f.write(f"crash {time.time()!r} {step}\n")
        raise RuntimeError("injected crash")
    time.sleep(0.01)  # a step's worth of waiting on data: the machine stays usable
