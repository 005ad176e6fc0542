"""Building hostile checkpoints as an attacker with write access to the checkpoint dir would:
change a file, then update the manifest's size and hash (and tensor table) so that full
verification passes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from conftest import NUMPY_TO_ST

import rtrain
from rtrain.checkpoint import hashing
from rtrain.checkpoint.safetensors_io import TensorBlob, build_header


def manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / "manifest.json").read_text())


def write_manifest(ckpt: Path, m: dict[str, Any]) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(m, indent=1, sort_keys=True))


def relist(ckpt: Path, name: str, data: bytes | None = None,
           tensors: dict[str, list] | None = None, **fields: Any) -> dict[str, Any]:
    """Write `data` to `name` (if given) and make the manifest list it with its real size and
    hash (and `tensors` as its tensor table, `fields` over the top level)."""
    m = manifest(ckpt)
    path = ckpt / name
    if data is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    alg = m.get("hash_alg", hashing.XXH3)
    m["files"][name] = {"size": path.stat().st_size, "hash": hashing.hash_file(path, alg)}
    if tensors is not None:
        m.setdefault("tensors", {})[name] = tensors
    m.update(fields)
    write_manifest(ckpt, m)
    return m


class _RunsCode:
    """Unpickling this writes `marker`: proof that a checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pickle ran')",))


def code_running_pickle(marker: Path) -> bytes:
    return pickle.dumps(_RunsCode(marker))


def safetensors_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    arrays = {n: np.require(a, requirements="C") for n, a in arrays.items()}
    blobs = [TensorBlob(n, NUMPY_TO_ST[a.dtype], tuple(a.shape), memoryview(a))
             for n, a in arrays.items()]
    return build_header(blobs) + b"".join(bytes(b.data.cast("B")) if b.data.nbytes else b""
                                          for b in blobs)


def table(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    return {n: [NUMPY_TO_ST[a.dtype], list(a.shape)] for n, a in arrays.items()}


def claim_huge_header(ckpt: Path, name: str = "model.safetensors") -> None:
    """The file's 8-byte header length says 8 GiB (same size, hash updated)."""
    data = bytearray((ckpt / name).read_bytes())
    data[:8] = (8 << 30).to_bytes(8, "little")
    relist(ckpt, name, bytes(data))


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its optimizer, the same for a seed."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def two_checkpoints(ckpt_dir: Path, **checkpointer: Any
                    ) -> tuple[dict[int, torch.Tensor], torch.optim.Optimizer]:
    """checkpoint-2 and checkpoint-4 of `make()`'s model trained a little (Checkpointer keywords
    as given, e.g. saving=rtrain.Saving(sharded=True)): their weights by step, and the optimizer."""
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir, keep=None,
                             **checkpointer)
    weights = {}
    for step in (2, 4):
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        ck.save(step)
        weights[step] = model.weight.detach().clone()
    return weights, opt
