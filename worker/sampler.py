"""A sampler whose position is kept in samples, so a run resumes at the exact next sample even
when the batch size changed between attempts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Yields dataset indices; a new permutation per epoch (seed + epoch) when `shuffle`.

    The order comes from its own generator, never torch's global one, and the epoch rolls over by
    itself when an epoch's indices are exhausted, so the usual loop needs no `set_epoch`:

        for epoch in itertools.count(ckpt.epoch):
            for batch in loader: ...

    With `num_workers > 0` the DataLoader fetches ahead of training; the position counts indices
    handed out, so resume may skip the few samples prefetched but not yet trained on. Use
    `num_workers=0` where exactness matters, or call `set_consumed` with the true count.
    """

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.num_samples = num_samples
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
        # seed from torch's global RNG; the Checkpointer uses the hook to undo that draw on the
        # first iteration after a mid-epoch restore, which is what makes resume bitwise exact.
        if self._before_next_iter is not None:
            hook, self._before_next_iter = self._before_next_iter, None
            hook()
        if self.position >= self.num_samples:
            self._next_epoch()
        order = self._order(self.epoch)
        while self.position < self.num_samples:
            i = order[self.position]
            self.position += 1
            self.samples_seen += 1
            yield i
        self._next_epoch()

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        left = self.num_samples - self.position
        return left if left > 0 else self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """For code written for DistributedSampler: jump to `epoch` (position 0) if it differs."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def set_consumed(self, position: int) -> None:
        self.samples_seen += position - self.position
        self.position = position

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != self.num_samples:
            raise ValueError(f"the dataset has {self.num_samples} samples, the checkpoint was "
                             f"made with {state['num_samples']}: the sample position would not "
                             "mean the same data")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self.samples_seen = state["samples_seen"]
        if self.position >= self.num_samples:
            self._next_epoch()

    @property
    def mid_epoch(self) -> bool:
        return 0 < self.position < self.num_samples
