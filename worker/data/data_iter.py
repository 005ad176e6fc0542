"""How a loader given to the Checkpointer is watched: `iter(loader)` goes through its position.

The loader's class is swapped for a subclass that changes nothing else, so the user's loop stays
`for batch in loader`; its `__iter__` asks the position (worker/data/position.py) for the iterator,
which is usually `Counted`: the loader's own iterator, counting each batch it hands to the loop.
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader

from rtrain.worker.data.data_workers import born_with_sigterm_blocked, worker_init


class Counting(Protocol):
    """A position that counts batches: `generation` names its newest iterator."""

    generation: int

    def took_batch(self) -> None: ...

    def ended(self) -> None: ...


class Counted:
    """The loader's iterator, counting each batch it hands to the loop."""

    def __init__(self, it: Any, pos: Counting, generation: int) -> None:
        self._it, self._pos, self._generation = it, pos, generation

    def __iter__(self) -> Counted:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._it)
        except StopIteration:
            if self._pos.generation == self._generation:
                self._pos.generation += 1  # an exhausted iterator ends its epoch once
                self._pos.ended()
            raise
        if self._pos.generation == self._generation:
            self._pos.took_batch()
        return batch

    def __len__(self) -> int:
        return len(self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


def watch_loader(loader: Any, pos: Any) -> bool:
    """Route `iter(loader)` through `pos.iterate`: the loader's class is swapped for a subclass
    that changes nothing else, so the user's loop stays `for batch in loader`. Gives the loader
    a generator for its base seeds when it has none; says whether it did."""
    if getattr(loader, "_rtrain_position", None) is not None:
        raise ValueError("this loader is already given to another Checkpointer")
    loader.__class__ = _watched_class(type(loader))
    loader._rtrain_position = pos
    if isinstance(loader, DataLoader) and loader.num_workers > 0:
        loader.worker_init_fn = functools.partial(worker_init, loader.worker_init_fn)
    if not isinstance(loader, DataLoader) or loader.generator is not None:
        return False
    loader.generator = torch.Generator()
    return True


def seed_iteration(loader: Any, seed: int, epoch: int, position: int) -> None:
    """Seed the base seeds of the iteration starting at `position` of `epoch`."""
    from rtrain.worker.data.sample_rng import sample_seed

    loader.generator.manual_seed(sample_seed(position, epoch=epoch, seed=seed))


@functools.cache
def _watched_class(cls: type) -> type:
    def fresh(self: Any) -> Any:
        with born_with_sigterm_blocked(self):  # the fork of the workers, not a fast-forward
            return cls.__iter__(self)

    def __iter__(self: Any) -> Any:
        return self._rtrain_position.iterate(lambda: fresh(self))

    return type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})
