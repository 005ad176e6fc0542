"""Where the data stream stands: the samples the training loop consumed, not those a DataLoader
fetched ahead of it.

A DataLoader with workers takes indices from its sampler `prefetch_factor x num_workers` batches
ahead of the loop, so the sampler's own count is ahead of what was trained on, by an amount a
resume must not skip. Given the loader (`Checkpointer(..., loader=loader)`), the position is
counted where the loop takes its batches:

- a torch `DataLoader` over a map-style dataset with a `ResumableSampler` (as `sampler=`, in
  a `BatchSampler`, or alone with `batch_size=None`): the loader's class is swapped for a
  subclass that behaves the same, whose iterator counts the batches handed to the loop; each
  `iter(loader)` rewinds the sampler to that count. Stored as the sampler's state (same format).
- torchdata's `StatefulDataLoader`: its own `state_dict()` (it counts consumed batches and
  collects each worker's dataset state), stored as JSON and tensors, never pickled.
- a torch `DataLoader` over an `IterableDataset`: the dataset's own `state_dict()` when it has one
  and no workers hold copies of it; otherwise the count of consumed batches, fast-forwarded on
  resume (the skipped batches are loaded and dropped) with a warning.

`iter(loader)` draws its workers' base seed from the loader's `generator`, or from torch's global
generator when it has none: a resumed run calls `iter` where the uninterrupted one did not
(mid-epoch), which would shift dropout and everything else drawn from the global generator. A
watched loader without a generator of its own is given one, seeded from where the iteration
starts, so `iter(loader)` never touches the global generator. The workers' generators still
differ after a mid-epoch resume (each advanced per sample it processed): randomness inside
`__getitem__` must come from `rtrain.sample_generator` (worker/data/sample_rng.py) to be exact.

The class swap and the counting iterator are in worker/data/data_iter.py; what the loader's
workers do with stop signals is in worker/data/data_workers.py.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from rtrain.worker.data.data_iter import Counted, seed_iteration, watch_loader
from rtrain.worker.data.sampler import ResumableSampler
from rtrain.worker.trainstate.tensors import decode, encode

log = logging.getLogger(__name__)


class SamplerPosition:
    """Only a sampler (no loader given): exact when the loader has no workers."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def samples_seen(self) -> int | None:
        return self.sampler.samples_seen

    def state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, st: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if "sampler" in st:
            self.sampler.load_state_dict(st["sampler"])

    def restored(self) -> None:
        if self.sampler.mid_epoch:
            # `iter(loader)` after restore draws a base seed from the global generator, which an
            # uninterrupted run did not do at this point: put the state back at the first fetch.
            cpu_state = torch.get_rng_state()
            self.sampler._before_next_iter = lambda: torch.set_rng_state(cpu_state)


class CountedLoader:
    """A torch DataLoader whose consumed samples are counted as the loop takes its batches."""

    def __init__(self, loader: DataLoader, sampler: ResumableSampler) -> None:
        if not getattr(loader, "in_order", True):
            raise ValueError("loader= needs a DataLoader with in_order=True: out-of-order batches "
                             "make the consumed position unknowable")
        self.loader, self.sampler = loader, sampler
        # Samples per batch: a BatchSampler's size (the last one of an epoch may be short), or
        # one per item with batch_size=None.
        self.batch = loader.batch_size or 1
        self.epoch, self.position = sampler.epoch, sampler.position
        self.samples_seen = sampler.samples_seen
        self.generation = 0  # only the newest iterator counts
        self.own_generator = watch_loader(loader, self)

    def iterate(self, make_iter: Any) -> Counted:
        """At `iter(loader)`: hand out again what was fetched ahead but never consumed."""
        self.sampler.seek(self.epoch, self.position, self.samples_seen)
        self.epoch, self.position = self.sampler.epoch, self.sampler.position
        self.generation += 1
        if self.own_generator:
            seed_iteration(self.loader, self.sampler.seed, self.epoch, self.position)
        return Counted(make_iter(), self, self.generation)

    def took_batch(self) -> None:
        n = min(self.batch, self.sampler.epoch_length - self.position)
        self.position += n
        self.samples_seen += n

    def ended(self) -> None:
        # A short last batch dropped by drop_last=True is never consumed: the epoch ends here.
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"sampler": {**self.sampler.state_dict(), "epoch": self.epoch,
                            "position": self.position, "samples_seen": self.samples_seen}}

    def load_state_dict(self, st: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        if "sampler" in st:
            self.sampler.load_state_dict(st["sampler"])
            self.epoch, self.position = self.sampler.epoch, self.sampler.position
            self.samples_seen = self.sampler.samples_seen

    def restored(self) -> None:
        pass  # `iter(loader)` does not draw from the global generator (see the module's doc)


class IterablePosition:
    """A torch DataLoader over an IterableDataset: consumed batches are counted; on resume the
    dataset's own state is loaded (no workers) or the consumed batches are skipped."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        ds = loader.dataset
        self.own_state = (loader.num_workers == 0 and callable(getattr(ds, "state_dict", None))
                          and callable(getattr(ds, "load_state_dict", None)))
        self.epoch, self.batches, self.skip = 0, 0, 0
        self.samples_seen = None
        self.generation = 0
        self.own_generator = watch_loader(loader, self)

    def iterate(self, make_iter: Any) -> Counted:
        self.generation += 1
        if self.own_generator:
            seed_iteration(self.loader, 0, self.epoch, self.batches)
        it = Counted(make_iter(), self, self.generation)
        self._fast_forward(it)
        return it

    def took_batch(self) -> None:
        self.batches += 1

    def ended(self) -> None:
        self.epoch, self.batches = self.epoch + 1, 0

    def state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        st: dict[str, Any] = {"epoch": self.epoch, "batches": self.batches,
                              "workers": self.loader.num_workers}
        if self.own_state:
            st["dataset"] = encode(self.loader.dataset.state_dict(), tensors, "loader.dataset")
        return {"loader": {"kind": "iterable", **st}}

    def load_state_dict(self, st: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        saved = st.get("loader")
        if not saved:
            return
        self.epoch, self.batches = saved["epoch"], saved["batches"]
        if self.own_state and "dataset" in saved:
            self.loader.dataset.load_state_dict(decode(saved["dataset"], tensors))
        else:
            self.skip = self.batches
            if saved.get("workers", self.loader.num_workers) != self.loader.num_workers:
                log.warning("data: the checkpoint was made with num_workers=%s, this loader has "
                            "%d: the workers' shards interleave differently, so skipping %d "
                            "batches does not land on the same samples", saved["workers"],
                            self.loader.num_workers, self.batches)

    def restored(self) -> None:
        pass

    def _fast_forward(self, it: Counted) -> None:
        """Load and drop the batches consumed before the checkpoint."""
        n, self.skip = self.skip, 0
        if not n:
            return
        t0 = time.monotonic()
        for _ in range(n):
            next(it._it)
        log.warning("data: skipped the %d batches consumed before the checkpoint by loading "
                    "them again (%.1f s); give the dataset state_dict()/load_state_dict() to "
                    "resume without reading them", n, time.monotonic() - t0)


class StatefulPosition:
    """torchdata's StatefulDataLoader: its own state, stored without pickle."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.sampler = None
        self.epoch = 0
        self.samples_seen = None
        self.own_generator = watch_loader(loader, self)
        self.iterations = 0

    def iterate(self, make_iter: Any) -> Any:
        # Its own state restores the workers' base seed; the draw just must not be global.
        self.iterations += 1
        if self.own_generator:
            seed_iteration(self.loader, 0, 0, self.iterations)
        return make_iter()

    def state_dict(self, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return {"loader": {"kind": "stateful_dataloader",
                           "state": encode(self.loader.state_dict(), tensors, "loader")}}

    def load_state_dict(self, st: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        saved = st.get("loader")
        if saved and saved.get("kind") == "stateful_dataloader":
            self.loader.load_state_dict(decode(saved["state"], tensors))

    def restored(self) -> None:
        pass


Position = SamplerPosition | CountedLoader | IterablePosition | StatefulPosition


def track(*, loader: Any = None) -> Position | None:
    """What the Checkpointer saves and restores of the data stream (None: nothing). `loader`
    is a loader or a bare ResumableSampler."""
    if isinstance(loader, ResumableSampler):
        return SamplerPosition(loader)
    if loader is None:
        return None
    if callable(getattr(loader, "state_dict", None)) and hasattr(loader, "load_state_dict"):
        return StatefulPosition(loader)
    if not isinstance(loader, DataLoader):
        raise TypeError(f"loader= takes a torch DataLoader, a loader with state_dict() and "
                        f"load_state_dict(), or a rtrain.ResumableSampler, not "
                        f"{type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        return IterablePosition(loader)
    found = _resumable_sampler(loader)
    if found is None:
        raise ValueError("loader= needs the DataLoader's sampler to be a rtrain.ResumableSampler "
                         "(DataLoader(..., sampler=rtrain.ResumableSampler(len(dataset), "
                         "seed=...)))")
    return CountedLoader(loader, found)


def bare_sampler(position: Position | None) -> ResumableSampler | None:
    """The sampler tracked without its loader, if that is how the data stream was given."""
    return position.sampler if isinstance(position, SamplerPosition) else None


def _resumable_sampler(loader: DataLoader) -> ResumableSampler | None:
    bs = loader.batch_sampler
    if bs is None:  # batch_size=None: the sampler yields one item at a time
        s = loader.sampler
    elif type(bs) is BatchSampler:
        s = bs.sampler
    else:
        raise ValueError(f"loader= does not know how many samples a batch of "
                         f"{type(bs).__name__} holds: pass its ResumableSampler as loader= "
                         f"(exact with num_workers=0)")
    return s if isinstance(s, ResumableSampler) else None
