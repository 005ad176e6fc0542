"""Capture and restore each component of the training state.

Tensors are grouped by file: `model`, `optimizer` (keyed by parameter *name*, so a changed model is
caught tensor by tensor), `extra` (RNG states, scheduler/scaler/user tensors). Everything else is
JSON in state.json.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from rtrain.supervisor.core.errors import StateMismatch
from rtrain.worker.trainstate import hyperparams
from rtrain.worker.trainstate.tensors import decode, encode

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- model

def model_tensors(model: torch.nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    sd = model.state_dict(keep_vars=True)
    if not trainable_only:
        return {k: v.detach() for k, v in sd.items()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach() for k, v in sd.items() if k in trainable}


def frozen_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()
            if k not in trainable}


def check_model(model_sd: dict[str, torch.Tensor], saved: dict[str, list],
                trainable_only: bool) -> list[str]:
    """Name the exact problem: shape and dtype mismatches, missing and unexpected keys (raised).

    `saved` is {name: [dtype code, shape]} of the tensors as read from the file. A dtype change
    is refused like a shape change: copying would cast (an int32 tensor into float32 weights)
    and hide a checkpoint that is not this model's. Returns warnings (none at present).
    """
    from rtrain.worker.trainstate.tensors import dtype_code

    problems: list[str] = []
    for name, (dtype, shape) in saved.items():
        t = model_sd.get(name)
        if t is None:
            continue
        if list(t.shape) != list(shape):
            problems.append(f"layer '{name}' shape mismatch: model {list(t.shape)}, "
                            f"checkpoint {list(shape)}")
        if dtype_code(t.dtype) != dtype:
            problems.append(f"layer '{name}' dtype mismatch: model {dtype_code(t.dtype)}, "
                            f"checkpoint {dtype}")
    expected = set(model_sd)
    missing = sorted(expected - set(saved))
    unexpected = sorted(set(saved) - expected)
    if missing and not trainable_only:
        problems.append(f"missing from the checkpoint: {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected in the checkpoint (not in the model): {_some(unexpected)}")
    if problems:
        raise StateMismatch("the checkpoint does not fit this model: " + "; ".join(problems))
    return []


def _some(names: list[str], n: int = 8) -> str:
    shown = ", ".join(f"'{x}'" for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def load_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    sd = model.state_dict(keep_vars=True)
    # check_model ran on the same tensors; checked again here because copy_ would broadcast a
    # [4] into a [2, 4] and cast an int32 into a float32 without a word.
    check_model(sd, {n: [_code(t), list(t.shape)] for n, t in tensors.items()}, True)
    with torch.no_grad():
        for name, t in tensors.items():
            sd[name].copy_(t)


def _code(t: torch.Tensor) -> str:
    from rtrain.worker.trainstate.tensors import dtype_code

    return dtype_code(t.dtype)


def fingerprint_items(sd: dict[str, torch.Tensor]) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for name in sorted(sd):
        t = sd[name]
        h.update(f"{name}:{list(t.shape)}:{t.dtype};".encode())
    return h.hexdigest()


def content_fingerprint(sd: dict[str, torch.Tensor]) -> str:
    """Hash of names, shapes and bytes: identifies a frozen base model exactly."""
    import xxhash

    from rtrain.worker.trainstate.tensors import cpu_contiguous, to_blob

    h = xxhash.xxh3_128()
    for name in sorted(sd):
        t = cpu_contiguous(sd[name])
        h.update(f"{name}:{list(t.shape)}:{t.dtype};".encode())
        h.update(to_blob(name, t).data)
    return h.hexdigest()


# ---------------------------------------------------------------- optimizer

def _param_names(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> list[str]:
    """Names of the optimizer's parameters in state_dict index order."""
    names_by_id = {}
    if model is not None:
        for n, p in model.named_parameters(remove_duplicate=False):
            names_by_id.setdefault(id(p), n)
    names = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            names.append(names_by_id.get(id(p), f"group{gi}.param{pi}"))
    return names


def optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = optimizer.state_dict()
    names = _param_names(optimizer, model)
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        name = names[idx]
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{name}/{key}"] = val.detach()
            else:
                plain.setdefault(name, {})[key] = val
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [names[i] for i in g["params"]]
        groups.append(g)
    extra_tensors: dict[str, torch.Tensor] = {}
    meta = {"param_groups": encode(groups, extra_tensors, "optimizer.groups"),
            "plain_state": encode(plain, extra_tensors, "optimizer.plain"),
            "class": type(optimizer).__name__}
    if extra_tensors:  # hyper-parameters held as tensors (e.g. a tensor lr)
        tensors.update({f"@{k}": v for k, v in extra_tensors.items()})
    return tensors, meta


# Per-parameter optimizer state that has the parameter's shape and dtype in torch.optim (the
# factored states of Adafactor, LBFGS's history and scalars like `step` have not).
_PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer",
                           "square_avg", "grad_avg", "acc_delta", "sum", "exp_inf", "prev",
                           "step_size", "ax"})


def check_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                    tensors: dict[str, torch.Tensor]) -> None:
    """Refuse optimizer state tensors that do not fit their parameter, before anything is
    loaded: load_state_dict would cast them and training would broadcast or fail later.

    A tensor is compared with the optimizer's current state of the same name when it has one,
    else (states known to be parameter-shaped) with the parameter itself."""
    names = _param_names(optimizer, model)
    params = {n: p for n, p in zip(names, (p for g in optimizer.param_groups
                                           for p in g["params"]), strict=True)}
    problems = []
    for key, t in tensors.items():
        if key.startswith("@"):
            continue
        name, _, sk = key.rpartition("/")
        p = params.get(name)
        if p is None:
            problems.append(f"state '{key}' is for a parameter the optimizer does not have")
            continue
        current = optimizer.state.get(p, {}).get(sk)
        if isinstance(current, torch.Tensor):
            want, what = current, "optimizer"
        elif sk in _PARAM_SHAPED and t.dim() > 0:
            want, what = p, "parameter"
        else:
            continue
        if t.shape != want.shape:
            problems.append(f"state '{key}' shape mismatch: {what} {list(want.shape)}, "
                            f"checkpoint {list(t.shape)}")
        if t.dtype != want.dtype:
            problems.append(f"state '{key}' dtype mismatch: {what} {_code(want)}, "
                            f"checkpoint {_code(t)}")
    if problems:
        raise StateMismatch("the optimizer state does not fit: " + "; ".join(problems[:8])
                            + (f" and {len(problems) - 8} more" if len(problems) > 8 else ""))


def load_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None,
                   tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                   ) -> list[hyperparams.Change]:
    """Load the state by parameter name. Returns the hyper-parameters the checkpoint replaced
    (worker/trainstate/hyperparams.py judges them after the restore)."""
    names = _param_names(optimizer, model)
    index = {n: i for i, n in enumerate(names)}
    hp_tensors = {k[1:]: v for k, v in tensors.items() if k.startswith("@")}
    groups = decode(meta["param_groups"], hp_tensors)
    plain = decode(meta["plain_state"], hp_tensors)
    if meta.get("class") and meta["class"] != type(optimizer).__name__:
        raise StateMismatch(f"optimizer is {type(optimizer).__name__} but the checkpoint holds "
                            f"{meta['class']} state: use the same optimizer class")
    if len(groups) != len(optimizer.param_groups):
        raise StateMismatch(f"optimizer has {len(optimizer.param_groups)} parameter groups, the "
                            f"checkpoint has {len(groups)}")
    saved_names = [n for g in groups for n in g["params"]]
    missing = sorted(set(names) - set(saved_names))
    unexpected = sorted(set(saved_names) - set(names))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"parameters without saved state: {_some(missing)}")
        if unexpected:
            parts.append(f"saved state for unknown parameters: {_some(unexpected)}")
        raise StateMismatch("optimizer state does not fit: " + "; ".join(parts))
    changes = hyperparams.differences(groups, optimizer.param_groups)
    check_optimizer(optimizer, model, tensors)
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        if key.startswith("@"):
            continue
        name, _, sk = key.rpartition("/")
        state.setdefault(index[name], {})[sk] = t
    for name, st in plain.items():
        state.setdefault(index[name], {}).update(st)
    sd = {"state": state,
          "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]}
    optimizer.load_state_dict(sd)
    return changes


# ---------------------------------------------------------------- RNG

def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return rng_encode(rng_raw())


def rng_raw() -> tuple[dict[str, torch.Tensor], Any, Any]:
    """Every generator's state as its library hands it out (copies): the part of `rng_state`
    cheap enough to take at every step (save at failure keeps it per step boundary)."""
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = s
    return tensors, random.getstate(), np.random.get_state(legacy=True)


def rng_encode(raw: tuple[dict[str, torch.Tensor], Any, Any]
               ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`rng_raw`'s states as a checkpoint holds them: tensors, and JSON for python and numpy."""
    tensors, python_state, np_state = raw
    plain = {
        "python": encode(python_state, {}, "rng.python"),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]),
                  float(np_state[4])],
    }
    return dict(tensors), plain


def load_rng(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    random.setstate(decode(plain["python"], {}))
    n = plain["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    # A restored tensor may be a view into its file's buffer; the generators' set_state reads
    # from the start of the storage, ignoring a view's offset: hand them memory of their own.
    torch.set_rng_state(tensors["rng/torch_cpu"].clone())
    cuda = sorted((k for k in tensors if k.startswith("rng/cuda/")),
                  key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda):
            log.warning("checkpoint has CUDA RNG states for %d devices, this process sees %d: "
                        "restoring the first %d", len(cuda), count, min(count, len(cuda)))
        torch.cuda.set_rng_state_all([tensors[k].clone() for k in cuda[:count]])
