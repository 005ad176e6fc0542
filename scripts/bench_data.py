"""What the exact data position costs per training step, with DataLoader workers.

    python scripts/bench_data.py [--workers 4] [--steps 60] [--rounds 5] [--batch 32]

Trains the vision example's CNN on its synthetic images (examples/vision/train.py) with two
loops, in one process, alternating blocks of `--steps` steps for `--rounds` rounds:

  exact  ResumableSampler, Checkpointer(loader=loader): the batches the loop takes are
         counted, indices carry their epoch (SampleIndex), iter(loader) is seeded from the
         position
  plain  the same loop without it: torch's RandomSampler (plain int indices), a Checkpointer
         without the loader; the dataset does the same work per sample

Both call `maybe_save` every step (no save falls due) and use persistent workers. Prints the
median step time of each and the difference; the difference between two loops on a shared
machine is noisy, so it also prints the machinery's main-process cost measured directly (the
counting iterator and the SampleIndex objects, per step) as a share of the step, and what
the per-sample generator costs in a worker against drawing the same augmentation from the
worker's global generator.
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler

ROOT = Path(__file__).resolve().parent.parent

import rtrain  # noqa: E402
from rtrain.worker.data.data_iter import Counted  # noqa: E402
from rtrain.worker.data.sampler import SampleIndex  # noqa: E402


def load_vision():
    spec = importlib.util.spec_from_file_location("vision_example",
                                                  ROOT / "examples" / "vision" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


vision = load_vision()


class PlainIndexImages(vision.SyntheticImages):
    """The example's images for plain int indices: the same work per sample (the per-sample
    generator is seeded as for epoch 0), so the two loops differ only by the machinery."""

    def __getitem__(self, i):
        return super().__getitem__(SampleIndex(i, 0, self.seed))


def make_loop(exact: bool, args, ckpt_dir: Path):
    torch.manual_seed(0)
    if exact:
        ds = vision.SyntheticImages(args.samples, args.resolution, 0)
        sampler = rtrain.ResumableSampler(len(ds), seed=0)
    else:
        ds = PlainIndexImages(args.samples, args.resolution, 0)
        sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        persistent_workers=args.workers > 0)
    model = vision.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, loader=loader if exact else None,
                               ckpt_dir=ckpt_dir / ("exact" if exact else "plain"))
    state = {"step": 0, "it": None}

    def batches():
        while True:
            yield from loader

    state["it"] = batches()

    def run(steps: int) -> list[float]:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            x, y = next(state["it"])
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            state["step"] += 1
            ckpt.maybe_save(state["step"])
            times.append(time.perf_counter() - t0)
        return times

    return run


def direct_cost(batch: int, n: int = 20000) -> float:
    """Seconds per step the machinery adds in the main process: one counted `next` and
    `batch` SampleIndex objects made and pickled (to a worker), against plain ints."""

    class Pos:
        generation = 1

        def took_batch(self):
            self.position = min(getattr(self, "position", 0) + batch, 10**12)

        def ended(self):
            pass

    data = list(range(n))
    t0 = time.perf_counter()
    for _ in iter(data):
        pass
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in Counted(iter(data), Pos(), 1):
        pass
    counted = (time.perf_counter() - t0 - plain) / n
    reps = max(1, n // 20)
    ints = list(range(batch))
    t0 = time.perf_counter()
    for _ in range(reps):
        pickle.dumps([int(i) for i in ints])
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(reps):
        pickle.dumps([SampleIndex(i, 3, 0) for i in ints])
    tagged = (time.perf_counter() - t0 - base) / reps
    return counted + tagged


def worker_cost(n: int = 5000) -> float:
    """Seconds per sample the per-sample generator adds in a worker, against drawing the same
    augmentation from the worker's global generator."""
    t0 = time.perf_counter()
    for _ in range(n):
        torch.rand(())
        torch.randint(-2, 3, (2,))
    base = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        g = rtrain.sample_generator(SampleIndex(i, 0, 0))
        torch.rand((), generator=g)
        torch.randint(-2, 3, (2,), generator=g)
    return (time.perf_counter() - t0 - base) / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="steps per block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--aa", action="store_true",
                   help="time the plain loop against a second plain loop: the noise floor")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        loops = {"exact": make_loop(not args.aa, args, Path(tmp) / "a"),
                 "plain": make_loop(False, args, Path(tmp) / "b")}
        for run in loops.values():
            run(10)  # start the workers, warm the caches
        times: dict[str, list[float]] = {"exact": [], "plain": []}
        ratios = []  # per round, paired: the two loops ran back to back
        for r in range(args.rounds):
            order = ("exact", "plain") if r % 2 == 0 else ("plain", "exact")
            block = {name: loops[name](args.steps) for name in order}
            for name, t in block.items():
                times[name] += t
            ratios.append(statistics.median(block["exact"]) / statistics.median(block["plain"]))
    med = {k: statistics.median(v) for k, v in times.items()}
    cost = direct_cost(args.batch)
    per_sample = worker_cost()
    print(f"workers {args.workers}, batch {args.batch}, resolution {args.resolution}, "
          f"{args.rounds} x {args.steps} steps per loop" + (" (A/A: both plain)" if args.aa
                                                             else ""))
    print(f"median step: exact {med['exact'] * 1e3:.2f} ms, plain {med['plain'] * 1e3:.2f} ms: "
          f"difference {(med['exact'] / med['plain'] - 1) * 100:+.2f} % (median of the "
          f"{args.rounds} paired rounds: {(statistics.median(ratios) - 1) * 100:+.2f} %)")
    print(f"machinery in the main process: {cost * 1e6:.1f} us per step = "
          f"{cost / med['plain'] * 100:.3f} % of a step")
    spread = per_sample * args.batch / max(1, args.workers)
    print(f"per-sample generator in the workers: {per_sample * 1e6:.1f} us per sample, "
          f"{spread * 1e6:.1f} us per step over {args.workers} workers = "
          f"{spread / med['plain'] * 100:.3f} % of a step (hidden while workers keep ahead)")


if __name__ == "__main__":
    main()
