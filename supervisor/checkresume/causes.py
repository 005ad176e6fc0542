"""Why a resumed run ended different: the likely causes, from the evidence the worker wrote into the
runs' manifests (`info.check_resume`, worker/checkresume/resume_check.py) and what the runs showed.
A pure function of data, table-tested.

Rules, in the order they are reported (a cause is named only when the runs differ):

1. a second uninterrupted run differs from the first: the script does not reproduce itself, so
   no resume can match it (non-deterministic kernels on CUDA, unseeded randomness, data order
   from threads or the clock); named first because it hides every other cause;
2. the resumed run did not load the checkpoint it was given (restore() not called, or called on
   another dir);
3. a global generator or the data position moved between `optimizer.step()` and
   `maybe_save()`: a batch drawn there (a prefetch) is lost on resume;
4. a DataLoader was mid-epoch at a save but not handed to the Checkpointer;
5. a bare sampler as `loader=` of a DataLoader that has workers (it runs ahead of the loop);
6. the script seeded a global generator after restore() loaded a checkpoint: the restored RNG
   state is replaced (with the model's dropout named when it has some);
7. the model draws from the RNG in training mode (dropout) and nothing above explains the
   difference: its masks follow the RNG the Checkpointer saves, so something replaces or
   bypasses that state;
8. CUDA without deterministic algorithms (cudnn.benchmark on makes it likelier);
9. none of the above: state the Checkpointer does not hold.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

_WHAT_MOVED = {"torch": "torch's RNG", "cuda": "the CUDA RNG", "python": "python's random",
               "numpy": "numpy's RNG", "data": "the loader (a batch taken)"}


class CauseKind(str, enum.Enum):
    NOT_REPRODUCIBLE = "not_reproducible"
    NOT_RESTORED = "not_restored"
    DRAWN_AFTER_STEP = "drawn_after_step"
    LOADER_NOT_HANDED = "loader_not_handed"
    SAMPLER_WITH_WORKERS = "sampler_with_workers"
    RESEEDED = "reseeded"
    DROPOUT_RNG = "dropout_rng"
    NONDETERMINISTIC = "nondeterministic"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Cause:
    kind: CauseKind
    reason: str  # the sentence a person reads


@dataclass(frozen=True)
class Evidence:
    """What the worker recorded across the runs, merged, and what the runs showed."""

    differs: bool
    reproducible: bool | None = None  # a second uninterrupted run matched; None: not run
    restored: bool = True  # every resumed run loaded the stop checkpoint
    moved_after_step: Mapping[str, int] = field(default_factory=dict)
    first_moved_step: int | None = None
    loaders_not_handed: tuple[str, ...] = ()
    sampler_with_workers: bool = False
    reseeded: tuple[str, ...] = ()
    rng_modules: tuple[str, ...] = ()
    device: str = "cpu"
    deterministic: bool = False
    cudnn_benchmark: bool = False


def merge(records: Iterable[Mapping[str, Any] | None], *, differs: bool,
          reproducible: bool | None, restored: bool) -> Evidence:
    """One Evidence from the `info.check_resume` records of the checkpoints looked at (None for
    a checkpoint without one); unknown or ill-typed fields are ignored."""
    moved: dict[str, int] = {}
    first: int | None = None
    loaders: list[str] = []
    reseeded: list[str] = []
    modules: list[str] = []
    sampler_workers = cuda = deterministic = benchmark = False
    for r in records:
        if not isinstance(r, Mapping):
            continue
        for k, n in _mapping(r.get("moved_after_step")).items():
            if isinstance(n, int) and n > 0:
                moved[str(k)] = max(moved.get(str(k), 0), n)
        f = r.get("first_moved_step")
        if isinstance(f, int) and (first is None or f < first):
            first = f
        _extend(loaders, r.get("loaders_not_handed"))
        _extend(reseeded, r.get("reseeded"))
        _extend(modules, r.get("rng_modules"))
        sampler_workers |= r.get("sampler_with_workers") is True
        cuda |= r.get("device") == "cuda"
        deterministic |= r.get("deterministic") is True
        benchmark |= r.get("cudnn_benchmark") is True
    return Evidence(differs=differs, reproducible=reproducible, restored=restored,
                    moved_after_step=moved, first_moved_step=first,
                    loaders_not_handed=tuple(loaders), sampler_with_workers=sampler_workers,
                    reseeded=tuple(reseeded), rng_modules=tuple(modules),
                    device="cuda" if cuda else "cpu", deterministic=deterministic,
                    cudnn_benchmark=benchmark)


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, Mapping) else {}


def _extend(into: list[str], values: Any) -> None:
    for v in values if isinstance(values, list) else []:
        if isinstance(v, str) and v not in into:
            into.append(v)


def _some(names: Iterable[str], n: int = 3) -> str:
    names = list(names)
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def likely_causes(ev: Evidence) -> list[Cause]:
    """The causes the evidence points to, most telling first (the rules in the docstring)."""
    if not ev.differs:
        return []
    out: list[Cause] = []
    if ev.reproducible is False:
        out.append(Cause(CauseKind.NOT_REPRODUCIBLE,
                         "two uninterrupted runs differ as well: the script does not reproduce "
                         "itself, so no resume can match it (non-deterministic kernels, "
                         "unseeded randomness, data order from threads or the clock); fix "
                         "that first"))
    if not ev.restored:
        out.append(Cause(CauseKind.NOT_RESTORED,
                         "the resumed run did not load the checkpoint it was given: call "
                         "ckpt.restore() before the loop and start from the step it returns"))
    if ev.moved_after_step:
        what = " and ".join(_WHAT_MOVED.get(k, k) for k in ev.moved_after_step)
        since = f" (from step {ev.first_moved_step})" if ev.first_moved_step is not None else ""
        out.append(Cause(CauseKind.DRAWN_AFTER_STEP,
                         f"{what} moved between optimizer.step() and maybe_save(){since}: a "
                         "batch drawn there (a prefetch) is not in the checkpoint, so the "
                         "resumed run trains on another one; take the next batch after "
                         "maybe_save(), at the top of the loop"))
    if ev.loaders_not_handed:
        out.append(Cause(CauseKind.LOADER_NOT_HANDED,
                         f"a DataLoader was mid-epoch at a save but not handed to the "
                         f"Checkpointer ({_some(ev.loaders_not_handed)}): its position is "
                         "lost on resume; pass it as Checkpointer(loader=...)"))
    if ev.sampler_with_workers:
        out.append(Cause(CauseKind.SAMPLER_WITH_WORKERS,
                         "the Checkpointer has the bare sampler (loader=sampler) of a "
                         "DataLoader with workers, whose sampler runs batches ahead of the "
                         "loop: pass the DataLoader as loader= instead"))
    dropout = (f"; the model's {_some(ev.rng_modules)} draw other masks"
               if ev.rng_modules else "")
    if ev.reseeded:
        out.append(Cause(CauseKind.RESEEDED,
                         f"the RNG is seeded after ckpt.restore() ({_some(ev.reseeded)}), "
                         f"replacing the RNG state the checkpoint restored{dropout}; seed "
                         "before restore(), or only on a fresh start"))
    elif ev.rng_modules and not out:
        out.append(Cause(CauseKind.DROPOUT_RNG,
                         f"the model draws from the RNG in training mode "
                         f"({_some(ev.rng_modules)}): its masks match only when the RNG state "
                         "the Checkpointer saves and restores is the one in force; look for "
                         "seeding after restore() that check-resume could not see, or a "
                         "generator of the script's own that no checkpoint holds"))
    if ev.device == "cuda" and not ev.deterministic:
        bench = " and cudnn.benchmark on" if ev.cudnn_benchmark else ""
        out.append(Cause(CauseKind.NONDETERMINISTIC,
                         f"CUDA kernels without torch.use_deterministic_algorithms(True)"
                         f"{bench} may differ from run to run"))
    if not out:
        out.append(Cause(CauseKind.UNKNOWN,
                         "no cause detected: look for training state the Checkpointer does not "
                         "hold (a second optimizer or model, an EMA copy, a torch.Generator "
                         "or counter of the script's own, data read by position in a file)"))
    return out
