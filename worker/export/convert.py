"""The torch side of `rtrain export`: `python -m rtrain.worker.export.convert REQUEST_JSON`.

`rtrain` never imports torch, so the exports that need it run here, in a process of their own:
every export to a `torch.save` file, and every source that is a pickle (a Lightning `.ckpt`, a
`torch.save` file, a Trainer's `pytorch_model.bin` or `optimizer.pt`). Pickles are loaded with
`torch.load(weights_only=True)` only: torch's restricted unpickler, which builds tensors and
plain containers and refuses every other global (a `GLOBAL os.system` + `REDUCE` is an error,
never a call). rtrain's own checkpoints are read without pickle, each file hashed against its
manifest as it is read (`rtrain.worker.trainstate.tensors.load_listed`).

The request (JSON, from `supervisor/commands/exporting.py`, which has already verified the
checkpoint) names the source, the output format and a temp path to create; the process writes
and fsyncs that file and prints one JSON line: `{"ok": true, "tensors": N, "notes": [...]}`, or
`{"ok": false, "exit": CODE, "reason": "..."}` and exits CODE (rtrain's exit codes). Publishing
the file (the rename, --force) is the caller's.

What is exported (supervisor/commands/exporting.py): the model's state dict; with `optimizer`,
for `torch` `{"model": state dict, "optimizer": optimizer state dict}` (the dict
`optimizer.load_state_dict` takes), for `safetensors` the optimizer's tensors as
`optimizer/<param>/<state key>` and its other values as JSON in the metadata's `optimizer`.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import crypt, hashing, manifest, safetensors_io
from rtrain.checkpoint.st_concat import PlainFile
from rtrain.checkpoint.verified_read import LoadError
from rtrain.checkpoint.verify import check_member_name
from rtrain.supervisor.core.errors import CheckpointError, RtrainError, UsageError
from rtrain.worker.trainstate.tensors import cpu_contiguous, decode, load_listed, read_any, to_blob

# Where a dict saved with torch.save keeps the model and the optimizer, in the order tried:
# Lightning's names, the PyTorch tutorials', then nanoGPT's and most hand-written loops'.
MODEL_KEYS = ("state_dict", "model_state_dict", "model")
OPTIMIZER_KEYS = ("optimizer_states", "optimizer_state_dict", "optimizer")
OPTIMIZER_PREFIX = "optimizer/"


def export(request: dict[str, Any]) -> dict[str, Any]:
    """Write the export the request describes; returns what the caller prints."""
    source, notes = request["source"], []
    if source == "rtrain":
        model, opt = _from_rtrain(Path(request["path"]), request["optimizer"])
    elif source == "hf":
        model, opt = _from_hf(Path(request["path"]), request["files"],
                              request.get("optimizer_file") if request["optimizer"] else None)
    elif source == "pickle":
        model, opt = _from_pickle(Path(request["path"]), request["optimizer"], notes)
    else:
        raise UsageError(f"unknown export source {source!r}")
    if request["optimizer"] and opt is None:
        raise CheckpointError(f"{Path(request['path']).name}: holds no optimizer state to "
                              "export: leave out --optimizer")
    out = Path(request["out"])
    if request["format"] == "torch":
        _save_torch(out, model if opt is None else {"model": model, "optimizer": opt})
    else:
        _save_safetensors(out, model, opt, request.get("metadata") or {})
    count = len(model) + (_count_tensors(opt) if opt is not None else 0)
    return {"tensors": count, "notes": notes}


# ---------------------------------------------------------------- sources

def _from_rtrain(path: Path, optimizer: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """rtrain's own format: no pickle, every byte hashed against the manifest as it is read."""
    from rtrain.checkpoint.hashing import load_signing_key
    from rtrain.worker.restoring.restore import read_state

    try:
        # Read again (the caller verified it a moment ago): signature and hashes are checked
        # against what this process reads, so a checkpoint swapped in between is caught.
        m = manifest.load(path)
        key = load_signing_key()
        manifest.check_signature(m, key)
        alg = hashing.manifest_alg(m, key)
        enc = crypt.load_encryption_key()
        problem = crypt.key_problem(m, enc)
        if problem is not None:
            raise CheckpointError(f"{path.name}: {problem}")
        model, _ = load_listed(path, "model.safetensors", m, alg, enc)
        opt = None
        if optimizer and "optimizer.safetensors" in m["files"]:
            st = read_state(path, m, alg, enc)
            if "optimizer" in st:
                tensors, _ = load_listed(path, "optimizer.safetensors", m, alg, enc)
                opt = _rtrain_optimizer(tensors, st["optimizer"])
    except (LoadError, manifest.ManifestError, hashing.HashAlgError, crypt.CryptError) as e:
        raise CheckpointError(f"{path.name}: cannot load: {e}") from None
    # Own storage per tensor, as model.state_dict() has: not views of the file's one buffer.
    return OrderedDict((k, v.clone()) for k, v in model.items()), opt


def _rtrain_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]
                      ) -> dict[str, Any]:
    """rtrain's optimizer state (keyed by parameter name, worker/trainstate/state.py) as
    torch's `optimizer.state_dict()` (keyed by index, in param_groups order)."""
    hp = {k[1:]: v for k, v in tensors.items() if k.startswith("@")}
    try:
        groups = decode(meta["param_groups"], hp)
        plain = decode(meta.get("plain_state", {}), hp)
        index = {n: i for i, n in enumerate(n for g in groups for n in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for key, t in tensors.items():
            if key.startswith("@"):
                continue
            name, _, sk = key.rpartition("/")
            state.setdefault(index[name], {})[sk] = t.clone()
        for name, st in plain.items():
            state.setdefault(index[name], {}).update(st)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LoadError(f"the optimizer state in state.json does not match "
                        f"optimizer.safetensors ({type(e).__name__}: {e})") from None
    return {"state": dict(sorted(state.items())),
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups]}


def _from_hf(path: Path, files: list[str], optimizer_file: str | None
             ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """A Trainer checkpoint: its weights (safetensors read directly, `.bin` shards through
    the restricted unpickler) and, when asked, its optimizer.pt."""
    model: dict[str, torch.Tensor] = OrderedDict()
    for name in files:
        member = _member(path, name)
        part = (_read_safetensors(member) if name.endswith(".safetensors")
                else _load(member))
        if not _is_state_dict(part):
            raise CheckpointError(f"{path.name}/{name}: no model weights found: not a dict "
                                  "of tensors")
        for k, v in part.items():
            if k in model:
                raise CheckpointError(f"{path.name}: tensor {k!r} is in two weight files")
            model[k] = v
    opt = None
    if optimizer_file is not None:
        opt = _load(_member(path, optimizer_file))
        if not _is_optimizer_state(opt):
            raise CheckpointError(f"{path.name}/{optimizer_file}: not an optimizer state dict")
    return model, opt


def _from_pickle(path: Path, optimizer: bool, notes: list[str]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    obj = _load(path)
    if _is_state_dict(obj):
        return obj, None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path.name}: no model weights found: it holds a "
                              f"{type(obj).__name__}, not a state dict or a dict with one")
    key = next((k for k in MODEL_KEYS if _is_state_dict(obj.get(k))), None)
    if key is None:
        keys = ", ".join(repr(k) for k in list(obj)[:8])
        raise CheckpointError(f"{path.name}: no model weights found: not a dict of tensors, "
                              f"and none under {', '.join(map(repr, MODEL_KEYS))} "
                              f"(its keys: {keys or 'none'})")
    notes.append(f"model weights from its {key!r} entry")
    opt = None
    if optimizer:
        okey = next((k for k in OPTIMIZER_KEYS if k in obj), None)
        opt = obj.get(okey) if okey is not None else None
        if okey == "optimizer_states" and isinstance(opt, list) and opt:
            if len(opt) > 1:
                notes.append(f"the first of its {len(opt)} optimizers")
            opt = opt[0]
        if opt is not None and not _is_optimizer_state(opt):
            raise CheckpointError(f"{path.name}: its {okey!r} entry is not an optimizer "
                                  "state dict")
    return obj[key], opt


def _member(root: Path, name: str) -> Path:
    try:
        return check_member_name(root, name)
    except ValueError as e:
        raise CheckpointError(f"{root.name}: {e}") from None


def _load(path: Path) -> Any:
    """torch.load with the restricted unpickler: tensors and plain containers, nothing run."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path.name}: refused by torch.load(weights_only=True), nothing "
                              f"in it was run: {_why(e)}") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{path.name}: cannot be read by torch.load: "
                              f"{_why(e)}") from None


def _why(e: BaseException) -> str:
    """The line of torch's message that names the cause (it wraps it in advice about
    weights_only=False, which rtrain never takes)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "GLOBAL" in ln or "Unsupported" in ln or "unsupported" in ln:
            return ln
    useful = [ln for ln in lines if not ln.startswith(("Weights only load failed",
                                                       "Check the documentation"))]
    return (useful or lines or [type(e).__name__])[0][:300]


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        with PlainFile(path) as f:
            tensors = read_any(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path.name}: {getattr(e, 'strerror', None) or e}") from None
    return OrderedDict((k, v.clone()) for k, v in tensors.items())


def _is_state_dict(obj: Any) -> bool:
    return (isinstance(obj, dict) and bool(obj)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def _is_optimizer_state(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("state"), dict) \
        and isinstance(obj.get("param_groups"), list)


def _count_tensors(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return 1
    if isinstance(obj, dict):
        return sum(_count_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_count_tensors(v) for v in obj)
    return 0


# ---------------------------------------------------------------- outputs

def _save_torch(out: Path, obj: Any) -> None:
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _save_safetensors(out: Path, model: dict[str, torch.Tensor], opt: dict[str, Any] | None,
                      metadata: dict[str, str]) -> None:
    tensors = dict(model)
    if opt is not None:
        plain, opt_tensors = _split_optimizer(opt)
        tensors.update(opt_tensors)
        metadata = {**metadata, "optimizer": json.dumps(plain, default=_json_default)}
    try:
        blobs = [to_blob(name, cpu_contiguous(t)) for name, t in tensors.items()]
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"cannot be written as safetensors: {e}; export to a .pt file "
                              "instead") from None
    safetensors_io.write_file(out, blobs, metadata)


def _split_optimizer(opt: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """torch's optimizer state dict -> (what is not a per-parameter tensor, as JSON-able data;
    the tensors as `optimizer/<param index>/<state key>`)."""
    tensors: dict[str, torch.Tensor] = {}
    rest: dict[str, dict[str, Any]] = {}
    for idx, st in opt["state"].items():
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"{OPTIMIZER_PREFIX}{idx}/{key}"] = val
            else:
                rest.setdefault(str(idx), {})[key] = val
    return {"param_groups": opt["param_groups"], "state": rest}, tensors


def _json_default(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (tuple, set)):
        return list(v)
    return repr(v)


def main(argv: list[str]) -> int:
    try:
        request = json.loads(argv[0])
        result = export(request)
    except RtrainError as e:
        print(json.dumps({"ok": False, "exit": int(e.exit_code), "reason": str(e)}), flush=True)
        return int(e.exit_code)
    print(json.dumps({"ok": True, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
