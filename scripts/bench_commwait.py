"""The per-step cost of timing DDP's gradient all-reduce for the straggler rule
(worker/commwait.py), in one process on a one-rank gloo group:

- the timing's own bookkeeping per bucket (what the default reduction adds to torch's);
- the timed hook's own cost per bucket around a script's hook: an inner hook whose future is
  already complete, against that inner hook alone (the clock reads, the lock, the chained
  future);
- a DDP step (forward, backward, all-reduce) of a small MLP cut into 1 bucket and into 8:
  DDP's built-in all-reduce, torch's `allreduce_hook` (a Python hook: what any hook costs) and
  rtrain's timed hook (a Python hook reducing as the built-in does), taken in turn step by step,
  medians.

usage: python scripts/bench_commwait.py [--steps 400] [--rounds 5]
Target: a few microseconds per bucket, no collective of its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from rtrain.worker.commwait import CommWaits, install


class Bucket:
    def is_last(self) -> bool:
        return True


def hook_cost(n: int) -> tuple[float, float]:
    """Seconds per call: the inner hook alone, and the timed hook around it (completion
    included: the future is done, so its callback runs at once)."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(torch.zeros(1))

    def inner(state, bucket):
        return done

    waits, bucket = CommWaits(None, inner), Bucket()
    out = []
    for call in (inner, waits.hook):
        best = float("inf")
        for _ in range(5):
            began = time.perf_counter()
            for _ in range(n):
                call(None, bucket)
            best = min(best, (time.perf_counter() - began) / n)
        out.append(best)
    return out[0], out[1]


def bookkeeping_cost(n: int) -> float:
    """Seconds per bucket of what the timed default reduction adds to torch's: a launch and a
    completion noted (two clock reads, the lock twice, a few stores)."""
    waits, bucket, clock = CommWaits(None, None), Bucket(), time.monotonic
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(n):
            waits.launched(bucket)
            waits.completed(clock())
        best = min(best, (time.perf_counter() - began) / n)
    return best


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])


def ddp(kind: str, buckets: int) -> nn.Module:
    # 8 layers of 256x256 float32, 257 KiB of gradients each: a cap just above one layer cuts
    # 8 buckets (after DDP's rebuild in the first step).
    m = nn.parallel.DistributedDataParallel(model(), bucket_cap_mb=25 if buckets == 1 else 0.26)
    if kind == "allreduce_hook":
        m.register_comm_hook(dist.group.WORLD, allreduce_hook)
    elif kind == "rtrain":
        assert install(m) is not None
    return m


def step(m: nn.Module, x: torch.Tensor) -> float:
    began = time.perf_counter()
    m(x).sum().backward()
    return time.perf_counter() - began


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"the timing's bookkeeping per bucket: {bookkeeping_cost(20000) * 1e6:.2f} us")
    inner, timed = hook_cost(20000)
    print(f"around a script's hook, per bucket: inner alone {inner * 1e6:.2f} us, "
          f"timed {timed * 1e6:.2f} us: +{(timed - inner) * 1e6:.2f} us")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.pop("RTRAIN_STATUS", None)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        x = torch.randn(16, 256)
        for buckets in (1, 8):
            kinds = ("built-in", "allreduce_hook", "rtrain")
            models = {k: ddp(k, buckets) for k in kinds}
            for k in kinds:  # DDP rebuilds its buckets after the first step
                for _ in range(10):
                    step(models[k], x)
            # Step by step in turn: a loaded machine's drift falls on every kind alike.
            times: dict[str, list[float]] = {k: [] for k in kinds}
            for _ in range(args.rounds * args.steps):
                for k in kinds:
                    times[k].append(step(models[k], x))
            med = {k: statistics.median(v) for k, v in times.items()}
            per = {k: f"{med[k] * 1e6:.0f} us" for k in kinds}
            extra = (med["rtrain"] - med["allreduce_hook"]) * 1e6
            print(f"{buckets} bucket(s), median step: {per}; rtrain's timing over "
                  f"allreduce_hook: {extra:+.1f} us per step ({extra / buckets:+.1f} per bucket)")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
