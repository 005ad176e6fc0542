"""A script that keeps one checkpoint of its own, rewritten in place every few steps under
--out (as a single-file training script does), and crashes at --crash-at in attempt 0 only.
Imports nothing heavy: the supervisor's side is under test, not torch's."""

import argparse
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--out", default="out")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--every", type=int, default=5)
p.add_argument("--crash-at", type=int, default=None)
p.add_argument("--step-s", type=float, default=0.1)
p.add_argument("--resume", default=None)
args = p.parse_args()

out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
first = os.environ.get("RTRAIN_ATTEMPT", "0") == "0"
print(f"resume from {args.resume}", flush=True)
for step in range(1, args.steps + 1):
    time.sleep(args.step_s)
    print(f"step {step}", flush=True)
    if step % args.every == 0:
        with open(out / "ckpt.pt", "wb") as f:  # in place, as the script being modelled does
            f.write(f"iter_num={step}".encode())
    if first and step == args.crash_at:
        print("crashing", file=sys.stderr, flush=True)
        os._exit(1)
