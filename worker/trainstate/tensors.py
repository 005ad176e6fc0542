"""Tensors <-> safetensors blobs, and JSON with tensors pulled out.

Non-tensor state (scheduler, scaler, optimizer hyper-parameters, python/numpy RNG, user extras)
goes to state.json; any tensor inside it is replaced by a reference into a safetensors file, so
loading never unpickles. Tuples and non-string dict keys are tagged so the round trip is exact.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint.safetensors_io import TensorBlob, read_tensors
from rtrain.checkpoint.st_concat import PlainFile
from rtrain.checkpoint.verified_read import LoadError, open_listed
from rtrain.worker.trainstate.hostmem import fresh_bytes

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.complex64: "C64",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code


CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"tensors of dtype {dtype} cannot be stored in safetensors") from None


def to_blob(name: str, t: torch.Tensor) -> TensorBlob:
    """A view of a CPU, contiguous tensor's bytes (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"tensor {name!r} must be a contiguous CPU tensor here")
    flat = t.detach().reshape(-1)
    data = flat.view(torch.uint8).numpy() if flat.numel() else memoryview(b"")
    return TensorBlob(name, dtype_code(t.dtype), tuple(t.shape), memoryview(data))


def _alloc(entries: dict[str, Any], nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """One buffer for a file's whole data section (its tensors become views of it): one
    allocation and large sequential reads instead of one of each per tensor."""
    for name, info in entries.items():
        if info["dtype"] not in CODE_DTYPES:
            raise LoadError(f"tensor {name!r}: dtype {info['dtype']} is not one this torch can "
                            "load")
    buffer = fresh_bytes(nbytes)
    return buffer, memoryview(buffer.numpy()) if nbytes else memoryview(bytearray())


def _make(buffer: torch.Tensor, name: str, info: dict[str, Any]) -> torch.Tensor:
    dtype = CODE_DTYPES[info["dtype"]]
    start, stop = info["data_offsets"]
    raw = buffer[start:stop]
    if start % dtype.itemsize:
        # safetensors packs tensors without padding, so one after an odd-sized tensor may start
        # off its element boundary, where a view cannot: that one gets memory of its own.
        raw = raw.clone()
    return raw.view(dtype).reshape(info["shape"])


def read_any(f: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file read through `f`: any reader with
    `verified_read.ListedFile`'s interface (`st_concat.PlainFile` for a file without a
    manifest). Raises ValueError naming what is wrong."""
    tensors, _ = read_tensors(f, _alloc, _make)
    return tensors


def load_listed(root: Path, name: str, manifest: dict[str, Any], alg: str, enc: Any = None,
                *, hashed_already: bool = False, map_data: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors of the safetensors file `name` of a checkpoint, and its `__metadata__`.

    One read, hashed as it goes, checked against the manifest's hash before anything is
    returned; the file's tensors (names, dtypes, shapes: what the header says, which is what
    was read) must be the manifest's `tensors` entry, so checks made from the manifest hold
    for the file. An encrypted file is decrypted with `enc` (its chunks authenticated) on the
    way. Raises LoadError with the reason.

    `hashed_already`: the caller knows every byte was hashed against the manifest by someone
    it trusts (rtrain, for a memory-tier snapshot it handed over): the file is read without
    hashing, its size still checked (an encrypted file is still decrypted and authenticated);
    with `map_data` it is mapped instead of read (`_Mapped`), for tensors that are only copied
    from (into the model's parameters): tensors that become state (the optimizer's) are read
    into fresh memory, which their first writes would otherwise fault in page by page.
    """
    alloc: Any = _alloc
    if hashed_already and manifest.get("encryption") is None:
        opened: Any = _unhashed(root, name, manifest, _Mapped if map_data else PlainFile)
        if map_data:
            alloc = opened.alloc
    else:
        opened = open_listed(root, name, manifest, alg, enc)
    with opened as f:
        try:
            tensors, meta = read_tensors(f, alloc, _make)
        except LoadError:
            raise
        except ValueError as e:
            raise LoadError(f"{name}: {e}") from None
    table = manifest.get("tensors", {})
    if not isinstance(table, dict):
        raise LoadError("the manifest's tensor table is not a map")
    listed = table.get(name)
    if listed is not None:
        _same_as_manifest(name, tensors, listed)
    return tensors, meta


class _Mapped(PlainFile):
    """A memory-tier snapshot's file, its data section mapped copy-on-write as the tensors'
    memory: nothing is copied or allocated at the load (the pages are the snapshot's, in shared
    memory), a tensor the training then changes gets its pages copied as it writes them, and
    the snapshot's file never changes."""

    def __init__(self, path: Path, *, follow_symlinks: bool = False) -> None:
        super().__init__(path, follow_symlinks=follow_symlinks)
        self.map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None

    def alloc(self, entries: dict[str, Any], nbytes: int) -> tuple[torch.Tensor, memoryview]:
        _alloc(entries, 0)  # the dtype checks
        start = self.pos  # the data section follows the header just read
        if self.map is None or start + nbytes != self.size:
            raise LoadError(f"{self.name}: the data section does not end the file")
        buffer = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=start)
        self._data_mapped = True
        return buffer, memoryview(b"")

    def readinto(self, buf: memoryview) -> None:
        if getattr(self, "_data_mapped", False):
            self.pos = self.size  # the data section is the mapping: nothing to read
            return
        super().readinto(buf)


def _unhashed(root: Path, name: str, manifest: dict[str, Any], kind: type) -> Any:
    entry = manifest.get("files", {}).get(name)
    try:
        f = kind(root / name, follow_symlinks=False)
    except OSError as e:
        raise LoadError(f"{name}: {e}") from None
    if not isinstance(entry, dict) or f.size != entry.get("size"):
        f.close()
        raise LoadError(f"{name} has {f.size} bytes, not the manifest's {entry!r}")
    return f


def _same_as_manifest(file: str, tensors: dict[str, torch.Tensor], listed: Any) -> None:
    if not isinstance(listed, dict):
        raise LoadError(f"the manifest's tensor list for {file} is not a map")
    for name in sorted(tensors.keys() | listed.keys()):
        t, entry = tensors.get(name), listed.get(name)
        if t is None or entry is None:
            where = "the manifest" if t is None else "the file"
            raise LoadError(f"{file}: tensor {name!r} is only in {where}")
        real = [dtype_code(t.dtype), list(t.shape)]
        if entry == real:
            continue
        claimed = (f"{entry[0]} {entry[1]}" if isinstance(entry, list) and len(entry) == 2
                   else repr(entry))
        raise LoadError(f"{file}: tensor {name!r} is {real[0]} {real[1]} in the file but "
                        f"{claimed} in the manifest")


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t if t.is_contiguous() else t.contiguous()


TENSOR_TAG = "__tensor__"
TUPLE_TAG = "__tuple__"
ITEMS_TAG = "__items__"
FLOAT_TAG = "__float__"


def encode(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """JSON-able form of `obj`; tensors are moved to `tensors` under keys starting with prefix."""
    if isinstance(obj, torch.Tensor):
        key = f"{prefix}#{len(tensors)}"
        tensors[key] = obj
        return {TENSOR_TAG: key}
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {FLOAT_TAG: repr(obj)}
    if isinstance(obj, (tuple, list)) and all(type(v) is int for v in obj):
        # A generator's state words (python's 625): one pass, not one call each; the live
        # state encodes them at every step boundary (worker/memtier/live.py).
        return {TUPLE_TAG: list(obj)} if isinstance(obj, tuple) else list(obj)
    if isinstance(obj, tuple):
        return {TUPLE_TAG: [encode(v, tensors, prefix) for v in obj]}
    if isinstance(obj, list):
        return [encode(v, tensors, prefix) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not (obj.keys() & {TENSOR_TAG, TUPLE_TAG,
                                                                       ITEMS_TAG, FLOAT_TAG}):
            return {k: encode(v, tensors, prefix) for k, v in obj.items()}
        return {ITEMS_TAG: [[encode(k, tensors, prefix), encode(v, tensors, prefix)]
                            for k, v in obj.items()]}
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # numpy scalar
        return encode(obj.item(), tensors, prefix)
    raise TypeError(f"value at {prefix!r} of type {type(obj).__name__} cannot be checkpointed: "
                    "use JSON values (numbers, strings, lists, dicts) or tensors")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if TENSOR_TAG in obj:
            return tensors[obj[TENSOR_TAG]]
        if TUPLE_TAG in obj:
            return tuple(decode(v, tensors) for v in obj[TUPLE_TAG])
        if ITEMS_TAG in obj:
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in obj[ITEMS_TAG]}
        if FLOAT_TAG in obj:
            return float(obj[FLOAT_TAG])
        return {k: decode(v, tensors) for k, v in obj.items()}
    return obj


def _hashable(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k
