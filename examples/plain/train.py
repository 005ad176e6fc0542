"""A plain training script that knows nothing of rtrain: argparse flags, its own torch.save
resume. rtrain supervises it from the outside (restarts, hang detection from output silence,
out-of-memory detection from stderr) and passes degraded knobs through argument templates:

    rtrain launch examples/plain/train.py --set batch_size=64 -- \
        --batch-size {batch_size} --ckpt {run_dir}/plain.pt

`--oom-above N` fakes a CUDA out-of-memory error when the batch size is above N (for demos on
a machine without a GPU); `--crash-at STEP` and `--hang-at STEP` fake the other failures.
"""

import argparse
import os
import time

import torch
from torch import nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt", default="plain.pt", help="checkpoint file (resumed if present)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--oom-above", type=int, default=0, help="demo: fake a CUDA OOM")
    p.add_argument("--crash-at", type=int, default=0, help="demo: raise at this step once")
    p.add_argument("--hang-at", type=int, default=0, help="demo: hang at this step once")
    return p.parse_args()


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Data is a function of the step, so a resumed run sees what it would have seen.
    g = torch.Generator().manual_seed(step)
    x = torch.randn(size, 16, generator=g)
    return x, x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(size, 1, generator=g)


def save(path: str, state: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a kill leaves the old file or the new one, never half


def fake_oom(args: argparse.Namespace) -> None:
    message = (f"CUDA out of memory. Tried to allocate 2.00 GiB (batch size {args.batch_size}; "
               f"fake, from --oom-above {args.oom_above})")
    raise RuntimeError(message)


def once(ckpt: str, what: str) -> bool:
    """True the first time only (a marker file by the checkpoint), so a restart gets past."""
    marker = f"{ckpt}.{what}"
    if os.path.exists(marker):
        return False
    open(marker, "w").close()
    return True


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if os.path.exists(args.ckpt):
        state = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"resumed from {args.ckpt} at step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        if args.oom_above and args.batch_size > args.oom_above:
            fake_oom(args)
        if step == args.crash_at and once(args.ckpt, "crashed"):
            raise RuntimeError(f"fake crash at step {step}")
        if step == args.hang_at and once(args.ckpt, "hung"):
            print(f"hanging at step {step}", flush=True)
            while True:
                time.sleep(60)
        x, y = batch(step, args.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}/{args.steps} loss {loss.item():.4f} batch {args.batch_size}",
              flush=True)
        if step % args.save_every == 0 or step == args.steps:
            save(args.ckpt, {"model": model.state_dict(), "opt": opt.state_dict(),
                             "step": step})
    print("done", flush=True)


if __name__ == "__main__":
    main()
