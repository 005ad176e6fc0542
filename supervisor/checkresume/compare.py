"""Two rtrain checkpoints compared tensor by tensor, byte for byte, without torch.

`read` takes a committed checkpoint (verified fully by the caller) apart: every tensor of every
safetensors file it lists, by file and name, as raw bytes, and every leaf of `state.json` (the
scheduler, sampler position, optimizer groups, python and numpy RNG) plus the manifest's step,
epoch and samples_seen. `compare` is pure: equal means the same bytes. For a tensor that differs
it says by how much where numpy can read the dtype (max abs difference, relative L2 of the
difference to the uninterrupted run's tensor, how many elements differ).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import manifest, safeio
from rtrain.checkpoint.safetensors_io import read_header
from rtrain.supervisor.core.errors import UsageError
from rtrain.supervisor.core.untrusted_text import safe

STATE = "state.json"
# The order a person reads differences in: weights first.
_FILE_ORDER = ("model.safetensors", "optimizer.safetensors", "extra.safetensors")
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "?"}
_MAX_STATE = 256 << 20


@dataclass(frozen=True)
class Tensor:
    dtype: str  # safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Contents:
    """What a checkpoint holds, as comparable data."""

    step: int
    tensors: dict[str, Tensor]  # "model.safetensors: fc.weight" -> tensor, in reading order
    state: dict[str, Any]  # "state.json: scheduler.last_epoch" -> leaf value


@dataclass(frozen=True)
class Difference:
    name: str  # "model.safetensors: fc.weight" or "state.json: sampler.position"
    how: str  # "max abs diff 3.1e-03, relative L2 1.2e-02 (12 of 64 elements)"


@dataclass(frozen=True)
class Comparison:
    compared: int  # tensors and state values looked at
    differences: tuple[Difference, ...]

    @property
    def identical(self) -> bool:
        return not self.differences


class CannotCompare(UsageError):
    """A checkpoint whose contents cannot be read here (encrypted, not rtrain's format)."""


def _file_rank(name: str) -> tuple[int, str]:
    return (_FILE_ORDER.index(name) if name in _FILE_ORDER else len(_FILE_ORDER), name)


def read(path: Path) -> Contents:
    """The contents of the committed checkpoint at `path`. Raises CannotCompare."""
    try:
        m = manifest.load(path)
    except manifest.ManifestError as e:
        raise CannotCompare(f"{path}: {e}") from None
    if m.get("encryption"):
        raise CannotCompare(f"{path.name} is encrypted: check-resume compares plain checkpoints "
                            "(run it without RTRAIN_ENCRYPTION_KEY)")
    tensors: dict[str, Tensor] = {}
    state: dict[str, Any] = {f"manifest: {k}": m[k] for k in ("step", "epoch", "samples_seen")}
    try:
        for name in sorted(m["files"], key=_file_rank):
            if name.endswith(".safetensors"):
                for tname, t in _tensors(path / name):
                    tensors[f"{name}: {tname}"] = t
            elif name == STATE:
                raw = safeio.read_limited(path / name, _MAX_STATE, follow_symlinks=True)
                state.update(flatten(safeio.parse_json(raw), STATE))
    except (OSError, ValueError) as e:
        raise CannotCompare(f"{path.name}: cannot read: {e}") from None
    return Contents(m["step"], tensors, state)


def _tensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    header = read_header(path)  # checked against the file's size
    with safeio.open_regular(path, follow_symlinks=True) as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    base = 8 + n
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                     key=lambda kv: kv[1]["data_offsets"][0])
    for name, info in entries:
        start, stop = info["data_offsets"]
        yield name, Tensor(info["dtype"], tuple(info["shape"]), raw[base + start:base + stop])


def flatten(obj: Any, prefix: str) -> dict[str, Any]:
    """Every leaf of a JSON value by its path: `state.json: scheduler.base_lrs[0]`."""
    out: dict[str, Any] = {}

    def walk(v: Any, path: str) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list) and v:
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")
        else:
            out[f"{prefix}: {path}"] = v

    walk(obj, "")
    return out


def compare(a: Contents, b: Contents) -> Comparison:
    """Where `b` (a resumed run's final checkpoint) differs from `a` (the uninterrupted run's):
    tensors in file order, then state values; names present on one side only included."""
    diffs: list[Difference] = []
    for name in [*a.tensors, *(n for n in b.tensors if n not in a.tensors)]:
        ta, tb = a.tensors.get(name), b.tensors.get(name)
        if ta is None or tb is None:
            diffs.append(Difference(name, "only in the " + ("resumed" if ta is None else
                                                            "uninterrupted") + " run"))
        elif (how := tensor_difference(ta, tb)) is not None:
            diffs.append(Difference(name, how))
    for name in [*a.state, *(n for n in b.state if n not in a.state)]:
        if name not in a.state or name not in b.state:
            diffs.append(Difference(name, "only in the " + ("resumed" if name not in a.state
                                                            else "uninterrupted") + " run"))
        elif json.dumps(a.state[name]) != json.dumps(b.state[name]):
            diffs.append(Difference(name, f"{_short(a.state[name])} vs "
                                          f"{_short(b.state[name])}"))
    names = set(a.tensors) | set(b.tensors) | set(a.state) | set(b.state)
    return Comparison(len(names), tuple(diffs))


def _short(v: Any) -> str:
    text = json.dumps(v)
    return safe(text if len(text) <= 40 else text[:37] + "...")


def tensor_difference(a: Tensor, b: Tensor) -> str | None:
    """None when `a` and `b` are the same bytes of the same dtype and shape; else how they
    differ, in numbers where the dtype allows."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"
    if a.data == b.data:
        return None
    x, y = _values(a), _values(b)
    if x is None or y is None:
        n = sum(p != q for p, q in zip(a.data, b.data, strict=True))
        return f"{n} of {len(a.data)} bytes differ"
    import numpy as np

    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x - y)
        count = int(np.count_nonzero(~((x == y) | (np.isnan(x) & np.isnan(y)))))
        if not count:
            return "same values, other bytes (NaN payloads or signed zeros)"
        if a.dtype[0] in "IU" or a.dtype == "BOOL":
            return f"{count} of {x.size} elements differ, max abs diff {np.nanmax(d):.0f}"
        norm = float(np.linalg.norm(np.nan_to_num(x)))
        rel = float(np.linalg.norm(np.nan_to_num(x - y))) / norm if norm else float("inf")
        return (f"max abs diff {np.nanmax(d):.3g}, relative L2 {rel:.3g} "
                f"({count} of {x.size} elements)")


def _values(t: Tensor) -> Any:
    """The tensor as float64 numpy values, or None for a dtype numpy cannot read."""
    import numpy as np

    if t.dtype == "BF16":
        wide = np.frombuffer(t.data, "<u2").astype(np.uint32) << 16
        return wide.view("<f4").astype(np.float64)
    if t.dtype not in _NUMPY:
        return None
    return np.frombuffer(t.data, _NUMPY[t.dtype]).astype(np.float64)
