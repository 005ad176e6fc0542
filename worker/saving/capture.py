"""Taking a save's contents at a step boundary: the live training objects (`Components`) turned
into a `Capture` of CPU tensors, state.json and manifest fields.

One process writes everything. Under torch.distributed, replicated state (DDP: identical on
every rank) is taken on rank 0 only; sharded state (FSDP/DTensor) is left to DCP; every rank
adds its own RNG state.

`Moving` is the part of a capture that changes inside a step while the model and optimizer do
not (RNG states, data position): kept at each step boundary so that a save at a failure can
write the boundary's step from the live, untouched model (worker/saving/failsave.py).
"""

from __future__ import annotations

import platform
import socket
from dataclasses import dataclass
from typing import Any

import torch

import rtrain
from rtrain.worker import dist
from rtrain.worker.data.position import Position
from rtrain.worker.saving import dist_ckpt
from rtrain.worker.saving.save_target import FILES, Capture
from rtrain.worker.settings import current as current_settings
from rtrain.worker.trainstate import state
from rtrain.worker.trainstate.tensors import cpu_contiguous, encode


class FrozenBase:
    """The fingerprint of a trainable-only model's frozen tensors: taken once and saved with
    each checkpoint, compared on restore (the base model must be the one trained on)."""

    def __init__(self) -> None:
        self.fingerprint: str | None = None

    def of(self, model: torch.nn.Module) -> str:
        if self.fingerprint is None:
            self.fingerprint = state.content_fingerprint(state.frozen_tensors(model))
        return self.fingerprint


@dataclass(frozen=True)
class Components:
    """The training objects one checkpoint holds, as given to the Checkpointer."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: Any
    data: Position | None
    trainable_only: bool
    sharded: bool | None  # None: detect (DTensor / FSDP parameters) when asked
    frozen: FrozenBase

    def is_sharded(self) -> bool:
        return self.sharded if self.sharded is not None else dist.is_sharded(self.model)

    def samples(self) -> int | None:
        return self.data.samples_seen if self.data is not None else None


@dataclass(frozen=True)
class Moving:
    """What moves during a step besides the model and optimizer, as it stood at a boundary:
    the generators' raw states (`state.rng_raw`) and the data position (its state.json part,
    its tensors, the samples consumed). Kilobytes; encoded only if it is ever saved."""

    rng: tuple[dict[str, torch.Tensor], Any, Any]
    data: dict[str, Any] | None
    data_tensors: dict[str, torch.Tensor]
    samples: int | None


def moving(parts: Components) -> Moving:
    """Take the moving parts now (at a step boundary)."""
    data_tensors: dict[str, torch.Tensor] = {}
    data = parts.data.state_dict(data_tensors) if parts.data is not None else None
    return Moving(state.rng_raw(), data, data_tensors, parts.samples())


def capture(parts: Components, step: int, epoch: int, lr_scale: float,
            metrics: dict[str, Any], extra: dict[str, Any],
            taken: Moving | None = None) -> Capture:
    """The save of `step`. With `taken`, the RNG states and data position are those it kept
    (a single process's save at a failure), not the live ones."""
    w = dist.world()
    if w is not None:
        if taken is not None:
            raise ValueError("a save from kept moving parts is for a single process only")
        return _capture_dist(parts, w, step, epoch, lr_scale, metrics, extra)
    return _capture_local(parts, step, epoch, lr_scale, metrics, extra, taken=taken)


def _capture_dist(parts: Components, w: dist.World, step: int, epoch: int, lr_scale: float,
                  metrics: dict[str, Any], extra: dict[str, Any]) -> Capture:
    sharded = parts.is_sharded()
    if sharded and parts.trainable_only:
        raise ValueError("trainable_only is not supported with sharded (FSDP/DTensor) state")
    rng_tensors, rng_plain = state.rng_state()
    sharded_sd = dist_ckpt.sharded_state(parts.model, parts.optimizer) if sharded else None
    if w.leader:
        # Replicated state (DDP: identical on every rank) is written once, by rank 0.
        cap = _capture_local(parts, step, epoch, lr_scale, metrics, extra, rng=False,
                             components=not sharded)
        cap.fields["info"].update(world_size=w.size,
                                  layout="sharded" if sharded else "replicated")
    else:  # what a rank's own memory-tier part says of itself (its manifest's fields)
        cap = Capture(step, {}, {}, {"epoch": epoch, "samples_seen": parts.samples() or 0})
    stem = dist_ckpt.rng_stem(w.rank)
    cap.tensors[stem] = {k: cpu_contiguous(v) for k, v in rng_tensors.items()}
    cap.world, cap.rank_rng, cap.sharded = w, rng_plain, sharded_sd
    return cap


def _capture_local(parts: Components, step: int, epoch: int, lr_scale: float,
                   metrics: dict[str, Any], extra: dict[str, Any], rng: bool = True,
                   components: bool = True, taken: Moving | None = None) -> Capture:
    tensors: dict[str, dict[str, torch.Tensor]] = {stem: {} for stem in FILES}
    st: dict[str, Any] = {"step": step, "epoch": epoch, "lr_scale": lr_scale}
    info: dict[str, Any] = {"trainable_only": parts.trainable_only, "world_size": 1}
    model, fingerprint = parts.model, None
    if model is not None:
        if components:
            tensors["model"] = state.model_tensors(model, parts.trainable_only)
        fingerprint = state.fingerprint_items(model.state_dict())
        if components and parts.trainable_only:
            info["frozen_fingerprint"] = parts.frozen.of(model)
    if parts.optimizer is not None and components:
        opt_tensors, st["optimizer"] = state.optimizer_state(parts.optimizer, model)
        if parts.trainable_only:
            keep = set(tensors["model"])
            opt_tensors = {k: v for k, v in opt_tensors.items()
                           if k.startswith("@") or k.rpartition("/")[0] in keep}
        tensors["optimizer"] = opt_tensors
    _capture_rest(parts, st, tensors["extra"], extra, rng, taken)
    for stem in FILES:
        tensors[stem] = {k: cpu_contiguous(v) for k, v in tensors[stem].items()}
    fields = {
        "epoch": epoch, "fingerprint": fingerprint,
        "samples_seen": (taken.samples if taken is not None else parts.samples()) or 0,
        "environment": environment(model), "settings": current_settings(),
        "metrics": {k: number(v) for k, v in metrics.items()}, "info": info,
    }
    return Capture(step, tensors, st, fields)


def _capture_rest(parts: Components, st: dict[str, Any], ex: dict[str, torch.Tensor],
                  extra: dict[str, Any], rng: bool, taken: Moving | None) -> None:
    """Scheduler, scaler, data position, RNG and the user's extras: into state.json (`st`),
    their tensors into extra.safetensors (`ex`); data position and RNG from `taken` if given."""
    if parts.scheduler is not None:
        st["scheduler"] = encode(parts.scheduler.state_dict(), ex, "scheduler")
    if parts.scaler is not None:
        st["scaler"] = encode(parts.scaler.state_dict(), ex, "scaler")
    if taken is not None:
        st.update(taken.data or {})
        ex.update(taken.data_tensors)
    elif parts.data is not None:
        st.update(parts.data.state_dict(ex))
    if rng:
        rng_tensors, st["rng"] = state.rng_encode(taken.rng if taken is not None
                                                  else state.rng_raw())
        ex.update(rng_tensors)
    st["extra"] = encode(extra, ex, "extra")


def number(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item()
    return v


def environment(model: torch.nn.Module | None) -> dict[str, Any]:
    device = "cpu"
    if model is not None:
        p = next(iter(model.parameters()), None)
        device = p.device.type if p is not None else "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": device, "rtrain": rtrain.__version__,
            "host": socket.gethostname()}
