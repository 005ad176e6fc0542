"""A small CNN on synthetic images, written for rtrain (see examples/README.md).

Knobs come from `rtrain.settings` (the supervisor lowers them after an out-of-memory failure):
batch_size, grad_accum, resolution, offload, lr, steps, workers. The images are generated from
the seed and the sample index, at any resolution, so nothing is downloaded and a resumed run sees
the same data. The DataLoader has worker processes; the Checkpointer is given the loader, so the
position it saves is what the loop consumed, and the random augmentation draws from a generator
made for the sample (`rtrain.sample_generator`), so a resume mid-epoch sees the same flips and
shifts.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rtrain
from rtrain.worker.guards import faults

CLASSES = 10


class SyntheticImages(Dataset):
    """Class k is a fixed random 8x8 pattern, upsampled to `resolution`, plus per-sample noise."""

    def __init__(self, num_samples: int, resolution: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        patterns = torch.randn(CLASSES, 3, 8, 8, generator=g)
        self.templates = F.interpolate(patterns, size=resolution, mode="bilinear",
                                       align_corners=False)
        self.num_samples, self.seed = num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = i % CLASSES
        noise = torch.randn(self.templates.shape[1:], generator=g)
        image = self.templates[label] + 0.5 * noise
        # Augmentation, new every epoch: a random flip and shift from the sample's generator
        # (torch's global generator in a worker would not come back the same after a resume).
        aug = rtrain.sample_generator(i)
        if torch.rand((), generator=aug) < 0.5:
            image = image.flip(-1)
        shift = torch.randint(-2, 3, (2,), generator=aug).tolist()
        return image.roll(shift, dims=(-2, -1)), label


def make_model() -> nn.Module:
    # Adaptive pooling makes the weights independent of the resolution knob.
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, CLASSES))


def move_optimizer_state(opt: torch.optim.Optimizer, device: str) -> None:
    """Page optimizer state (Adam moments) between the GPU and host memory: off the GPU during
    forward and backward, where activations need the room. Adam's `step` counters stay put."""
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step":
                st[k] = v.to(device, non_blocking=True)


def forever(loader: DataLoader):
    while True:  # the ResumableSampler rolls the epoch over by itself
        yield from loader


def main() -> None:
    s = rtrain.settings(batch_size=32, grad_accum=1, resolution=32, offload=False, lr=0.01,
                        steps=200, save_every=20, log_every=10, samples=4096, seed=0,
                        workers=2)
    rtrain.install_excepthook()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    offload = bool(s.offload) and device == "cuda"
    if s.offload and not offload:
        print("offload=True: nothing to offload on the CPU (no-op)", flush=True)
    torch.manual_seed(s.seed)
    dataset = SyntheticImages(s.samples, s.resolution, s.seed)
    sampler = rtrain.ResumableSampler(len(dataset), seed=s.seed)
    loader = DataLoader(dataset, batch_size=s.batch_size, sampler=sampler,
                        num_workers=s.workers, persistent_workers=s.workers > 0)
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)

    def schedule(step: int) -> float:  # warm-up then cosine, as a factor of the lr knob
        return min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / s.steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scheduler=sched, loader=loader,
                               every=s.save_every,
                               restoring=rtrain.Restoring(map_location=device))
    start = ckpt.restore()
    # The lr knob wins over the checkpoint's: the supervisor cuts it after a non-finite loss.
    sched.base_lrs = [s.lr] * len(opt.param_groups)
    for g in opt.param_groups:
        g["initial_lr"], g["lr"] = s.lr, s.lr * schedule(sched.last_epoch)
    if offload:
        move_optimizer_state(opt, "cpu")
    print(f"{'resumed at' if start else 'starting at'} step {start}: settings {dict(s)}",
          flush=True)

    def loss_of(batch, step):
        x, y = batch
        faults.in_step(batch_size=len(x))
        loss = F.cross_entropy(model(x), y) / s.grad_accum
        return faults.poison_loss(loss, step)

    backoff = rtrain.OOMBackoff(settings=s)
    guard = rtrain.NonFiniteGuard(max_consecutive=5)
    batches = forever(loader)
    value = float("nan")
    for step in range(start + 1, s.steps + 1):
        loss = torch.zeros((), device=device)
        for _ in range(s.grad_accum):
            x, y = next(batches)
            loss += backoff.run(functools.partial(loss_of, step=step),
                                (x.to(device), y.to(device)))
        if not guard.skip(loss, model=model, step=step):
            if offload:
                move_optimizer_state(opt, device)
            opt.step()
            if offload:
                move_optimizer_state(opt, "cpu")
        opt.zero_grad(set_to_none=True)
        sched.step()
        value = loss.item()
        if step % s.log_every == 0 or step == start + 1:
            micro = backoff.micro or s.batch_size  # smaller after an in-process back-off
            accum = s.grad_accum * math.ceil(s.batch_size / micro)
            print(f"step {step} loss {value:.4f} batch {micro}x{accum} "
                  f"res {s.resolution} lr {opt.param_groups[0]['lr']:.2e}", flush=True)
        ckpt.maybe_save(step, metrics={"loss": value})
    if start < s.steps:
        ckpt.save(s.steps)  # the final state, whatever the schedule
    ckpt.close()
    print(f"done: {s.steps} steps, final loss {value:.4f}", flush=True)


if __name__ == "__main__":
    main()
