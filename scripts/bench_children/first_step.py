"""Import torch, build a model, run one step, write the wall time of that step's end."""

import sys
import time

import torch
from torch import nn

model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(32, 256)).pow(2).mean()
loss.backward()
opt.step()
with open(sys.argv[1], "w") as f:
    f.write(repr(time.time()))
