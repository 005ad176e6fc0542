"""Per-sample randomness that a resume reproduces: seeded from the run seed, the epoch and the
sample's index, never from where a DataLoader worker's generator happens to be.

Torch seeds each worker from a base seed drawn at `iter(loader)`, and each worker's generator
advances with every sample it processed; after a mid-epoch resume both differ (a new base seed,
batches dealt to workers from the first again), so augmentation drawn from the worker's global
generator cannot come back the same. Drawing from a generator made for the sample does:

    def __getitem__(self, i):
        g = rtrain.sample_generator(i)               # i: the index a ResumableSampler yielded
        crop = torch.randint(0, 8, (2,), generator=g)

    def __getitem__(self, i):                        # code that draws from the global RNGs
        with rtrain.seeded(i):                       # (torchvision transforms, random, numpy)
            return self.transform(self.images[i])
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    # splitmix64's finaliser: nearby inputs give unrelated outputs.
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sample_seed(index: int, *, epoch: int | None = None, seed: int | None = None) -> int:
    """A 63-bit seed for this sample in this epoch of this run.

    `epoch` and `seed` default to those a `ResumableSampler` attached to the index it yielded;
    with a plain int index, pass them.
    """
    epoch = getattr(index, "epoch", None) if epoch is None else epoch
    seed = getattr(index, "seed", None) if seed is None else seed
    if epoch is None or seed is None:
        raise TypeError("sample_seed needs the epoch and the run seed: use the index a "
                        "rtrain.ResumableSampler yielded, or pass epoch= and seed=")
    # Odd multipliers make each step a bijection of the 64-bit state; one finaliser spreads it.
    x = (((seed * 0xD1B54A32D192ED03 + epoch) & _MASK) * 0xAEF17502108EF2D9 + index) & _MASK
    return _mix(x) >> 1


def sample_generator(index: int, *, epoch: int | None = None, seed: int | None = None,
                     device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator seeded for this sample (see `sample_seed`)."""
    g = torch.Generator(device=device)
    g.manual_seed(sample_seed(index, epoch=epoch, seed=seed))
    return g


@contextlib.contextmanager
def seeded(index: int, *, epoch: int | None = None, seed: int | None = None) -> Iterator[int]:
    """Seed torch's CPU, python's and numpy's global generators for this sample, and put them
    back after: for code that draws from the global generators (torchvision transforms)."""
    s = sample_seed(index, epoch=epoch, seed=seed)
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s & 0xFFFFFFFF)
        try:
            yield s
        finally:
            random.setstate(py)
            np.random.set_state(npy)
