"""Print a CUDA out-of-memory error and exit 1 while the batch size is above LIMIT.

usage: oom_print.py LIMIT [--bs N]     without --bs the batch comes from rtrain.settings()
"""

import argparse
import sys

import rtrain  # torch-free parts only: settings

p = argparse.ArgumentParser()
p.add_argument("limit", type=int)
p.add_argument("--bs", type=int)
args = p.parse_args()
s = rtrain.settings(batch_size=64, grad_accum=1)
bs = args.bs if args.bs is not None else s.batch_size
print(f"batch_size={bs} grad_accum={s.grad_accum}", flush=True)
if bs > args.limit:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
          "(GPU 0; 79.11 GiB total capacity)", file=sys.stderr, flush=True)
    sys.exit(1)
