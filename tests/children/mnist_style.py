"""Shaped like pytorch/examples' mnist/main.py: trains for --epochs, prints its progress, and
saves `mnist_cnn.pt` only at the end (with --save-model); it has no resume of any kind. Each
attempt writes `started-<attempt>` beside itself, so a test knows when it is training. Imports
nothing heavy: the supervisor's side is under test, not torch's."""

import argparse
import os
import pickle
import time

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--batches", type=int, default=10)
p.add_argument("--batch-s", type=float, default=0.1)
p.add_argument("--save-model", action="store_true")
args = p.parse_args()

with open(f"started-{os.environ.get('RTRAIN_ATTEMPT', 'x')}", "w") as f:
    f.write(str(os.getpid()))
for epoch in range(1, args.epochs + 1):
    for batch in range(args.batches):
        time.sleep(args.batch_s)
        print(f"Train Epoch: {epoch} [{batch}/{args.batches}]\tLoss: {1.0 / (batch + 1):.6f}",
              flush=True)
if args.save_model:
    with open("mnist_cnn.pt", "wb") as f:
        pickle.dump({"weights": [0.0] * 4}, f)
