"""Samplers whose position is kept in samples, so a run resumes at the exact next sample even
when the batch size changed between attempts.

Each index they yield is a `SampleIndex`: an `int` that also carries the epoch and the seed it
was drawn for, so code inside a DataLoader worker can seed per-sample randomness from it
(`rtrain.sample_generator`) without knowing the epoch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from rtrain.supervisor.core.errors import StateMismatch


class PositionMismatch(StateMismatch, ValueError):
    """The checkpoint's sample position does not fit this run's data (another dataset size, a
    mid-epoch position under another world size): like a model that does not fit, a fault of
    the run, not of the checkpoint (an older one would not fit either). Still a ValueError, as
    it always was to callers."""


class SampleIndex(int):
    """A dataset index (an `int` everywhere) with the `epoch` and `seed` it was drawn for."""

    epoch: int
    seed: int

    def __new__(cls, index: int, epoch: int, seed: int) -> SampleIndex:
        obj = super().__new__(cls, index)
        obj.epoch, obj.seed = epoch, seed
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # to a worker process: value, epoch and seed
        return (SampleIndex, (int(self), self.epoch, self.seed))


class ResumableSampler(Sampler[int]):
    """Yields dataset indices; a new permutation per epoch (seed + epoch) when `shuffle`.

    The order comes from its own generator, never torch's global one, and the epoch rolls over by
    itself when an epoch's indices are exhausted, so the usual loop needs no `set_epoch`:

        for epoch in itertools.count(ckpt.epoch):
            for batch in loader: ...

    `position` counts indices handed out. A DataLoader with workers takes indices ahead of the
    training loop; give the loader to the Checkpointer (`loader=`) and it counts the samples the
    loop consumed instead (worker/data/position.py), which is what a checkpoint stores.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = num_samples
        self.epoch_length = num_samples  # indices this sampler yields per epoch
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # indices handed out in this epoch
        self.samples_seen = 0  # across all epochs
        self._before_next_iter: Callable[[], None] | None = None

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        # This body runs at the DataLoader's first fetch, after `iter(loader)` has drawn its base
        # seed from torch's global RNG; without a loader to watch, the Checkpointer uses the hook
        # to undo that draw on the first iteration after a mid-epoch restore.
        if self._before_next_iter is not None:
            hook, self._before_next_iter = self._before_next_iter, None
            hook()
        if self.position >= self.epoch_length:
            self._next_epoch()
        epoch, seed = self.epoch, self.seed
        order = self._order(epoch)
        while self.position < self.epoch_length:
            i = order[self.position]
            self.position += 1
            self.samples_seen += 1
            yield SampleIndex(i, epoch, seed)
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        left = self.epoch_length - self.position
        return left if left > 0 else self.epoch_length

    def set_epoch(self, epoch: int) -> None:
        """For code written for DistributedSampler: jump to `epoch` (position 0) if it differs."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def set_consumed(self, position: int) -> None:
        self.samples_seen += position - self.position
        self.position = position

    def seek(self, epoch: int, position: int, samples_seen: int) -> None:
        """Continue from exactly here at the next `iter()` (the samples the loop consumed)."""
        self.epoch, self.position, self.samples_seen = epoch, position, samples_seen
        if self.position >= self.epoch_length:
            self._next_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise PositionMismatch(f"the dataset has {self.num_samples} samples, the checkpoint "
                                   f"was made with {state['num_samples']}: the sample position "
                                   "would not mean the same data")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.seek(state["epoch"], state["position"], state["samples_seen"])

    @property
    def mid_epoch(self) -> bool:
        return 0 < self.position < self.epoch_length


class DistributedResumableSampler(ResumableSampler):
    """`DistributedSampler`'s split with a resumable position: rank `r` of `R` takes every R-th
    index of the epoch's permutation (the same permutation DistributedSampler draws for the same
    seed and epoch), padded by repeating its start so every rank gets as many samples
    (`drop_last=False`), or cut to a multiple of R (`drop_last=True`).

    `position` counts this rank's samples; every rank consumes as many per step, so the one
    position rank 0 saves is every rank's. `num_replicas` and `rank` default to the process
    group's.
    """

    def __init__(self, num_samples: int, num_replicas: int | None = None,
                 rank: int | None = None, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        super().__init__(num_samples, seed=seed, shuffle=shuffle)
        if num_replicas is None or rank is None:
            import torch.distributed as tdist

            if not (tdist.is_available() and tdist.is_initialized()):
                raise ValueError("DistributedResumableSampler needs num_replicas and rank, or an "
                                 "initialised process group to take them from")
            num_replicas = tdist.get_world_size() if num_replicas is None else num_replicas
            rank = tdist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.num_replicas, self.rank, self.drop_last = num_replicas, rank, drop_last
        if drop_last:
            self.epoch_length = num_samples // num_replicas
            if self.epoch_length == 0:
                raise ValueError(f"{num_samples} samples cannot give each of {num_replicas} "
                                 "ranks one with drop_last=True")
        else:
            self.epoch_length = math.ceil(num_samples / num_replicas)

    def _order(self, epoch: int) -> list[int]:
        order = super()._order(epoch)
        total = self.epoch_length * self.num_replicas
        while len(order) < total:  # pad with the order's own start, as DistributedSampler does
            order += order[: total - len(order)]
        return order[self.rank:total:self.num_replicas]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "num_replicas": self.num_replicas,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("num_replicas", 1)
        n = state["num_samples"]
        saved_length = n // saved if state.get("drop_last") else math.ceil(n / saved)
        if saved != self.num_replicas and 0 < state["position"] < saved_length:
            raise PositionMismatch(f"the checkpoint was made mid-epoch with {saved} ranks, this "
                                   f"run has {self.num_replicas}: each rank's position would not "
                                   "mean the same data (resume with the same world size, or from "
                                   "an epoch-boundary checkpoint)")
        if saved != self.num_replicas:
            state = {**state, "position": 0}
        super().load_state_dict(state)
