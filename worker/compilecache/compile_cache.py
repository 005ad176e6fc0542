"""Compiled graphs that travel with a checkpoint: torch's portable compile-cache artifacts.

A relaunch on the same node finds what `torch.compile` compiled in the run dir's cache
(supervisor/compilecache/dirs.py). A fresh node (a Slurm requeue elsewhere, a new pod) has none,
so at each save the worker also writes torch's "mega-cache"
(`torch.compiler.save_cache_artifacts()`) and the compiled kernels of inductor's cache dir (which
the mega-cache leaves out on a CPU: worker/compilecache/compile_pack.py) beside the checkpoint as
`compile-cache.bin`, listed and hashed in its manifest like every file (so the mirror carries it),
and at restore hands the mega-cache to `torch.compiler.load_cache_artifacts()` and puts the kernels
back, which fills the local caches before the first compiled step. A torch without that API saves
and loads nothing; `Saving(compile_cache=False)` neither saves nor loads.

What torch's loader does with the bytes (torch 2.13, torch/compiler/_cache.py): it parses a
framed list of (artifact type, key, content) with no pickle, then each artifact's
`populate_cache` writes the content into the local caches under a path built from the key
(`os.path.join(cache_dir, key)`: a key with `..` writes outside it); the inductor artifact is
unpickled at once when Triton's bundler is on (`pickle.loads` in
`FxGraphCache._emit_triton_bundle`, the GPU default), and every artifact is unpickled, and its
generated Python and shared libraries run, at the next compile that hits it. Loading these
bytes is therefore running code from the checkpoint, so they are guarded like a pickle (the
threat model's promise that bytes in the checkpoint dir never execute unless trusted):

- only from a checkpoint whose manifest is signed and verified under the run's key, or with
  `Restoring(allow_pickle=True)` (the user trusts the checkpoint dir with code already);
- only the bytes the manifest lists, read once and hashed as they are read (verified_read), so
  the bytes checked are the bytes loaded; no larger than `Saving(compile_cache_max_mb=)`;
- only kernel files named as inductor names them, written only inside its cache dir;
- only from the same torch version and device kind (CPU architecture, or CUDA compute
  capability) that wrote them: anything else would miss anyway, or worse, load code built for
  another machine.

Anything else is ignored with a warning and a `compile_cache_ignored` heartbeat (rtrain records
a `compile_cache` event): the checkpoint itself still loads, and the first step compiles cold.
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rtrain.checkpoint import crypt
from rtrain.checkpoint.verified_read import LoadError, read_listed
from rtrain.worker import runtime
from rtrain.worker.compilecache import compile_pack

log = logging.getLogger(__name__)

FILE = "compile-cache.bin"
UNSIGNED = "the checkpoint is not signed"
INFO_KEY = "compile_cache"  # manifest info.compile_cache: {bytes, torch, device, artifacts}


def device_kind(model: torch.nn.Module | None) -> str:
    """What compiled code is built for: "cpu/<machine>" or "cuda/sm_<major><minor>"."""
    p = next(iter(model.parameters()), None) if model is not None else None
    if p is not None and p.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(p.device)
        return f"cuda/sm_{major}{minor}"
    if p is not None and p.device.type not in ("cpu", "meta"):
        return p.device.type
    return f"cpu/{platform.machine()}"


def available() -> bool:
    """This torch has the mega-cache API."""
    compiler = getattr(torch, "compiler", None)
    return (hasattr(compiler, "save_cache_artifacts")
            and hasattr(compiler, "load_cache_artifacts"))


@dataclass(frozen=True)
class Artifacts:
    """What one save writes beside the checkpoint."""

    data: bytes
    info: dict[str, Any]


def inductor_cache_dir() -> Path:
    """Where inductor keeps its caches in this process (rtrain sets it to the run dir's)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return Path(cache_dir())
    except (ImportError, OSError):
        return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or tempfile.gettempdir())


def collect(model: torch.nn.Module | None, max_mb: float) -> Artifacts | None:
    """This process's compile artifacts so far (everything it compiled or loaded from a cache) and
    the kernels in inductor's cache dir, packed (worker/compilecache/compile_pack.py); None: nothing
    compiled, no API, or more than `max_mb` (said in the log)."""
    if not available():
        return None
    try:
        got = torch.compiler.save_cache_artifacts()
    except Exception as e:  # torch's own failure must not fail the save
        log.warning("compile cache not saved: torch.compiler.save_cache_artifacts() failed "
                    "(%s: %s)", type(e).__name__, e)
        return None
    if got is None:
        return None
    torch_bytes, cache_info = got
    limit = max_mb * 2**20
    kernels: dict[str, bytes] = {}
    total = len(torch_bytes)
    for name, path in compile_pack.kernel_files(inductor_cache_dir()):
        try:
            kernels[name] = path.read_bytes()
        except OSError:
            continue  # removed or being written meanwhile: it is rebuilt if needed
        total += len(kernels[name])
        if total > limit:
            break
    data = compile_pack.pack(torch_bytes, kernels)
    if len(data) > limit:
        log.warning("compile cache not saved with the checkpoint: %.1f MiB is over "
                    "Saving(compile_cache_max_mb=%g)", len(data) / 2**20, max_mb)
        return None
    kinds = getattr(cache_info, "artifacts", {}) or {}
    info = {"bytes": len(data), "torch": torch.__version__, "device": device_kind(model),
            "artifacts": {str(k): len(v) for k, v in kinds.items()}, "kernels": len(kernels)}
    return Artifacts(bytes(data), info)


def judge(manifest: dict[str, Any], *, signed: bool, allow_pickle: bool, torch_version: str,
          device: str, max_bytes: int) -> str | None:
    """Why the checkpoint's compile cache must not be loaded here, or None to load it. Pure:
    the manifest has verified (and its signature checked, when `signed`)."""
    info = (manifest.get("info") or {}).get(INFO_KEY)
    entry = (manifest.get("files") or {}).get(FILE)
    if not isinstance(info, dict) or not isinstance(entry, dict):
        return "the manifest does not list it"
    if not (signed or allow_pickle):
        return (f"{UNSIGNED}: loading it would run code from the checkpoint "
                "dir (sign checkpoints with RTRAIN_SIGNING_KEY, or trust the dir with "
                "Restoring(allow_pickle=True))")
    if info.get("torch") != torch_version:
        return f"written by torch {info.get('torch')!r}, this is torch {torch_version}"
    if info.get("device") != device:
        return f"built for {info.get('device')!r}, this process compiles for {device!r}"
    size = entry.get("size")
    if not isinstance(size, int) or size > max_bytes:
        return (f"{size} bytes is over Saving(compile_cache_max_mb=) "
                f"({max_bytes / 2**20:g} MiB)")
    return None


def restore(path: Path, manifest: dict[str, Any], alg: str, *, signed: bool,
            allow_pickle: bool, model: torch.nn.Module | None, max_mb: float,
            enc: crypt.EncryptionKey | None) -> bool:
    """Load the checkpoint's compile cache into this process's local caches when `judge`
    allows; True when torch took it. Never raises: a cache that cannot be used is a cold
    compile, not a failed restore."""
    if FILE not in (manifest.get("files") or {}):
        return False  # saved without one (nothing compiled): nothing to say
    if not available():
        return _ignored(path, "this torch has no torch.compiler.load_cache_artifacts")
    why = judge(manifest, signed=signed, allow_pickle=allow_pickle,
                torch_version=torch.__version__, device=device_kind(model),
                max_bytes=int(max_mb * 2**20))
    if why is not None:
        # Unsigned is the default, not a mistake: said in the event, not warned at every resume.
        return _ignored(path, why, quiet=why.startswith(UNSIGNED))
    try:
        data = read_listed(path, FILE, manifest, alg, limit=int(max_mb * 2**20), enc=enc)
    except (LoadError, OSError) as e:
        return _ignored(path, f"cannot read it: {e}")
    try:
        torch_bytes, kernels = compile_pack.unpack(data)
    except compile_pack.PackError as e:
        return _ignored(path, f"not a compile cache rtrain wrote: {e}")
    try:
        loaded = torch.compiler.load_cache_artifacts(torch_bytes)
    except Exception as e:  # a cache torch cannot take is a cold compile
        return _ignored(path, f"torch refused it ({type(e).__name__}: {str(e)[:200]})")
    if loaded is None:
        return _ignored(path, "torch could not parse it")
    try:
        placed = compile_pack.place(inductor_cache_dir(), kernels)
    except OSError as e:
        log.warning("compile cache of %s: kernels not placed (%s); they are rebuilt",
                    path.name, e)
        placed = 0
    kinds = getattr(loaded, "artifacts", {}) or {}
    count = sum(len(v) for v in kinds.values())
    detail = f"{len(data) / 2**20:.1f} MiB, {count} artifacts, {placed} kernels"
    log.info("compile cache of %s loaded (%s)", path.name, detail)
    runtime.heartbeat(event="compile_cache_loaded", reason=detail)
    return True


def _ignored(path: Path, why: str, quiet: bool = False) -> bool:
    log.log(logging.INFO if quiet else logging.WARNING,
            "compile cache of %s ignored: %s; the first step compiles cold", path.name, why)
    runtime.heartbeat(event="compile_cache_ignored", reason=why)
    return False
