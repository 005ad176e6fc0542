"""state.json's schema: what a restore may assume of a checkpoint's non-tensor state.

state.json is hashed like every file of a checkpoint, but an unsigned hash proves only that the
bytes are the ones the manifest lists: whoever can write the directory can edit the file and
recompute the hash, and a checkpoint written by another rtrain version may lay it out
differently. So before anything is applied (`worker/restoring/restore.py`) and in full verification
(`verify.verify` at `full`: `rtrain inspect --verify full`, the launch's resume pick, prune),
state.json is checked field by field against what the worker writes (`worker/saving/capture.py`):

    step          int >= 0, the manifest's step                            required
    epoch         int >= 0
    lr_scale      positive finite number (the learning-rate factor applied)
    rng           {"python": tagged tuple (version, 625 uint32 words, gauss), "numpy":
                  ["MT19937", 624 uint32 words, pos 0..624, has_gauss 0/1, cached gauss]}
    optimizer     {"param_groups": [{"params": [names], ...}], "plain_state": {name: {...}},
                  "class": str}
    scheduler     a map (the scheduler's state_dict, tagged)
    scaler        a map, or empty
    sampler       {"num_samples", "epoch", "position", "samples_seen": int >= 0, "seed": int,
                  "shuffle": bool, optional "num_replicas" int >= 1, "drop_last" bool}
    loader        {"kind": "iterable", "epoch", "batches": int >= 0, ...} or
                  {"kind": "stateful_dataloader", "state": ...}
    extra         the user's extras: any JSON, tags well formed

Tags (`worker/trainstate/tensors.py`: `__tensor__`, `__tuple__`, `__items__`, `__float__`) must be
well formed wherever they appear, and a tensor reference must name a tensor the checkpoint holds
when the caller knows its tensors. Unknown top-level fields are allowed (a newer writer's
additions). Pure and torch-free: data in, the first problems out.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

TENSOR_TAG, TUPLE_TAG, ITEMS_TAG, FLOAT_TAG = "__tensor__", "__tuple__", "__items__", "__float__"
_MAX_INT = 2**63 - 1
_WORD = 2**32  # a Mersenne Twister word is a uint32
_SHOWN = 3  # problems named in one reason


class StateSchemaError(ValueError):
    """state.json does not have the shape the worker writes; str() names the fields at fault."""


def check(st: Any, *, step: int | None = None, extra_tensors: Collection[str] | None = None,
          optimizer_tensors: Collection[str] | None = None) -> None:
    """Raise StateSchemaError naming the first problems of `st` (state.json, parsed), if any.

    `step`: the manifest's step, which state.json's must equal. `extra_tensors` /
    `optimizer_tensors`: the tensor names of extra.safetensors / optimizer.safetensors, when
    known, which the tagged references must name (optimizer hyper-parameters as `@<ref>`)."""
    found = problems(st, step=step, extra_tensors=extra_tensors,
                     optimizer_tensors=optimizer_tensors)
    if found:
        more = f" (and {len(found) - _SHOWN} more)" if len(found) > _SHOWN else ""
        raise StateSchemaError("state.json " + "; ".join(found[:_SHOWN]) + more)


def problems(st: Any, *, step: int | None = None, extra_tensors: Collection[str] | None = None,
             optimizer_tensors: Collection[str] | None = None) -> list[str]:
    """Every problem found, each a phrase naming the field ("field 'rng.numpy' is missing")."""
    if not isinstance(st, dict):
        return ["is not a JSON object"]
    out: list[str] = []
    if "step" not in st:
        out.append("field 'step' is missing")
    elif _count(st["step"]) and step is not None and st["step"] != step:
        out.append(f"field 'step' is {st['step']}, the manifest's step is {step}: it belongs to "
                   "another checkpoint")
    for name in ("step", "epoch"):
        if name in st and not _count(st[name]):
            out.append(_wrong(name, st[name], "an integer >= 0"))
    if "lr_scale" in st and not _positive(st["lr_scale"]):
        out.append(_wrong("lr_scale", st["lr_scale"], "a positive number"))
    if "rng" in st:
        out += rng_problems(st["rng"], "rng")
    if "optimizer" in st:
        out += _optimizer(st["optimizer"], optimizer_tensors)
    for name in ("scheduler", "scaler"):
        value = st.get(name)
        if name in st and not isinstance(value, dict) and not (name == "scaler" and not value):
            out.append(_wrong(name, value, "a map"))
    if "sampler" in st:
        out += _sampler(st["sampler"])
    if "loader" in st:
        out += _loader(st["loader"])
    for name in ("scheduler", "scaler", "sampler", "loader", "extra"):
        if name in st:
            out += tag_problems(st[name], name, extra_tensors)
    return out


def rng_problems(rng: Any, where: str) -> list[str]:
    """The generators' states of `worker/trainstate/state.rng_encode` (also a rank's RNG
    metadata)."""
    if not isinstance(rng, dict):
        return [_wrong(where, rng, "a map")]
    out = [f"field '{where}.{k}' is missing" for k in ("python", "numpy") if k not in rng]
    py = rng.get("python")
    if "python" in rng:
        parts = py.get(TUPLE_TAG) if isinstance(py, dict) else None
        words = parts[1].get(TUPLE_TAG) if (isinstance(parts, list) and len(parts) == 3
                                            and isinstance(parts[1], dict)) else None
        if (not isinstance(words, list) or not _int(parts[0]) or not _words(words, 625)
                or not (parts[2] is None or _number(parts[2]))):
            out.append(f"field '{where}.python' is not python's random state (a version, 625 "
                       "32-bit words and the cached gauss)")
    n = rng.get("numpy")
    if "numpy" in rng and not (
            isinstance(n, list) and len(n) == 5 and n[0] == "MT19937" and isinstance(n[1], list)
            and _words(n[1], 624) and _int(n[2]) and 0 <= n[2] <= 624 and n[3] in (0, 1)
            and not isinstance(n[3], bool) and _number(n[4])):
        out.append(f"field '{where}.numpy' is not numpy's MT19937 state ('MT19937', 624 32-bit "
                   "words, a position, has_gauss, the cached gauss)")
    return out


def tag_problems(obj: Any, where: str, tensors: Collection[str] | None,
                 prefix: str = "") -> list[str]:
    """Malformed tags in `obj` (they would make decoding fail), and tensor references to
    tensors not in `tensors` (looked up as prefix + reference) when it is given."""
    out: list[str] = []
    stack: list[tuple[Any, str]] = [(obj, where)]
    while stack and len(out) < _SHOWN:
        value, at = stack.pop()
        if isinstance(value, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(value)]
            continue
        if not isinstance(value, dict):
            continue
        if TENSOR_TAG in value:
            ref = value[TENSOR_TAG]
            if not isinstance(ref, str):
                out.append(f"field '{at}' is a tensor reference that is not a name")
            elif tensors is not None and prefix + ref not in tensors:
                out.append(f"field '{at}' refers to tensor {ref[:80]!r}, which the checkpoint "
                           "does not hold")
        elif TUPLE_TAG in value:
            if not isinstance(value[TUPLE_TAG], list):
                out.append(f"field '{at}' is a tuple that is not a list")
            else:
                stack.append((value[TUPLE_TAG], at))
        elif ITEMS_TAG in value:
            items = value[ITEMS_TAG]
            if not isinstance(items, list) or not all(
                    isinstance(p, list) and len(p) == 2 for p in items):
                out.append(f"field '{at}' is a map of items that are not [key, value] pairs")
            else:
                stack += [(p, at) for p in items]
        elif FLOAT_TAG in value:
            if not _float_text(value[FLOAT_TAG]):
                out.append(f"field '{at}' is a float tag that is not a number")
        else:
            stack += [(v, f"{at}.{k}") for k, v in value.items()]
    return out


def _optimizer(opt: Any, tensors: Collection[str] | None) -> list[str]:
    if not isinstance(opt, dict):
        return [_wrong("optimizer", opt, "a map")]
    out = [f"field 'optimizer.{k}' is missing" for k in ("param_groups", "plain_state")
           if k not in opt]
    groups = opt.get("param_groups")
    if "param_groups" in opt and (not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list)
            and all(isinstance(p, str) for p in g["params"]) for g in groups)):
        out.append("field 'optimizer.param_groups' is not a list of groups, each with its "
                   "parameters' names")
    plain = opt.get("plain_state")
    if "plain_state" in opt and not (isinstance(plain, dict) and all(
            isinstance(v, dict) for k, v in plain.items() if k != ITEMS_TAG)):
        out.append("field 'optimizer.plain_state' is not a map of parameter names to states")
    if "class" in opt and not isinstance(opt["class"], str):
        out.append(_wrong("optimizer.class", opt["class"], "a class name"))
    for key in ("param_groups", "plain_state"):
        if key in opt:
            out += tag_problems(opt[key], f"optimizer.{key}", tensors, prefix="@")
    return out


_SAMPLER_COUNTS = ("num_samples", "epoch", "position", "samples_seen")


def _sampler(s: Any) -> list[str]:
    if not isinstance(s, dict):
        return [_wrong("sampler", s, "a map")]
    out = [f"field 'sampler.{k}' is missing" for k in (*_SAMPLER_COUNTS, "seed", "shuffle")
           if k not in s]
    out += [_wrong(f"sampler.{k}", s[k], "an integer >= 0") for k in _SAMPLER_COUNTS
            if k in s and not _count(s[k])]
    if "seed" in s and not _int(s["seed"]):
        out.append(_wrong("sampler.seed", s["seed"], "an integer"))
    out += [_wrong(f"sampler.{k}", s[k], "true or false") for k in ("shuffle", "drop_last")
            if k in s and not isinstance(s[k], bool)]
    if "num_replicas" in s and not (_count(s["num_replicas"]) and s["num_replicas"] >= 1):
        out.append(_wrong("sampler.num_replicas", s["num_replicas"], "an integer >= 1"))
    return out


def _loader(ld: Any) -> list[str]:
    if not isinstance(ld, dict):
        return [_wrong("loader", ld, "a map")]
    kind = ld.get("kind")
    if kind == "iterable":
        out = [f"field 'loader.{k}' is missing" for k in ("epoch", "batches") if k not in ld]
        return out + [_wrong(f"loader.{k}", ld[k], "an integer >= 0")
                      for k in ("epoch", "batches", "workers") if k in ld and not _count(ld[k])]
    if kind == "stateful_dataloader":
        return [] if "state" in ld else ["field 'loader.state' is missing"]
    return [_wrong("loader.kind", kind, "'iterable' or 'stateful_dataloader'")]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _count(v: Any) -> bool:
    return _int(v) and 0 <= v <= _MAX_INT


def _number(v: Any) -> bool:
    return (_int(v) or isinstance(v, float)) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return _number(v) and 0 < v < 1e30


def _words(values: list, n: int) -> bool:
    return len(values) == n and all(_int(w) and 0 <= w < _WORD for w in values)


def _float_text(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return isinstance(v, str)


def _wrong(name: str, value: Any, want: str) -> str:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"field '{name}' is {shown}, not {want}"

