"""The manifest: the one file that makes a checkpoint exist (contract 3).

Schema (version 1), a JSON object:

    format        "rtrain-checkpoint"
    version       1
    step          int, the step to run next after restoring
    epoch         int
    samples_seen  int, samples consumed since the start of training
    created       float, unix time of the commit
    files         {relative path: {"size": int, "hash": str}}      every file but the manifest
                  (for an encrypted checkpoint: of the encrypted bytes)
    hash_alg      "xxh3-128", or "blake3" when signed
    tensors       {relative path: {tensor name: [dtype, shape]}}   safetensors contents; absent
                  when encrypted with RTRAIN_ENCRYPT_METADATA=1
    encryption    optional {"scheme": "aes-256-gcm-chunked-v1", "key_fingerprint": 16 hex,
                  "chunk_size": int, "tensors_listed": false (only when tensors is absent)}:
                  every listed file is encrypted (checkpoint/encrypted_file.py); never the key
                  itself
    run           optional str, 32 hex digits: the run that wrote it (checkpoint/runid.py), copied
                  from the checkpoint dir's .rtrain-run at the save; absent: no run's
    fingerprint   str, hash of the model's (name, shape, dtype) list
    environment   {"python", "torch", "cuda", "device", "rtrain", "host"}
    settings      {knob: value} in force (RTRAIN_SETTINGS)
    metrics       {name: number}
    info          {free-form facts: trainable_only, frozen_fingerprint, world_size, ...;
                  saved_at_failure: true and failure: the exception's type when the worker
                  committed it as an exception ended the process (worker/saving/failsave.py)}
    signature     optional {"alg": "blake3-keyed", "value": hex} over the canonical rest
"""

from __future__ import annotations

import hmac
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from rtrain.checkpoint import hashing, runid, safeio
from rtrain.checkpoint.layout import MANIFEST

FORMAT = "rtrain-checkpoint"
VERSION = 1

REQUIRED = {
    "format": str,
    "version": int,
    "step": int,
    "epoch": int,
    "samples_seen": int,
    "created": (int, float),
    "files": dict,
}


class ManifestError(ValueError):
    """The manifest cannot be read or trusted; str() is the reason a person reads."""


def canonical_bytes(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_manifest(manifest: dict[str, Any], key: bytes) -> None:
    manifest["signature"] = {
        "alg": hashing.SIGN_ALG,
        "value": hashing.sign(canonical_bytes(manifest), key),
    }


def check_signature(manifest: dict[str, Any], key: bytes | None) -> None:
    """With a key configured, unsigned or altered manifests are refused."""
    if key is None:
        return
    sig = manifest.get("signature")
    if not isinstance(sig, dict) or "value" not in sig:
        raise ManifestError("unsigned, but a signing key is configured (RTRAIN_SIGNING_KEY)")
    if sig.get("alg") != hashing.SIGN_ALG:
        raise ManifestError(f"signature algorithm {sig.get('alg')!r} is not {hashing.SIGN_ALG!r}")
    if not hmac.compare_digest(str(sig["value"]), hashing.sign(canonical_bytes(manifest), key)):
        raise ManifestError(
            "signature does not match: the manifest was altered or signed with another key"
        )


def _jsonable(obj: Any) -> Any:
    # Metrics may be NaN/inf (a diverged loss is exactly what one wants to see); keep the
    # manifest strict JSON by writing them as strings.
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(_jsonable(manifest), indent=1, sort_keys=True, allow_nan=False).encode()


MAX_BYTES = 16 << 20
"""Largest manifest read. A real one is kilobytes (a model of 10,000 tensors: ~1 MiB); a larger
one is refused unread rather than parsed at ~10x its size in memory."""

# Fields that are counts or byte sizes: a negative or astronomically large value is not a fact
# about a real run, and downstream arithmetic (formatting, int64 heartbeats) must not meet one.
_COUNTS = ("step", "epoch", "samples_seen")
_MAX_COUNT = 2**63 - 1


def _read(ckpt_path: Path) -> bytes:
    path = ckpt_path / MANIFEST
    try:
        # The checkpoint dir itself: a link would make the manifest (and every file it lists)
        # come from wherever the link points.
        st = os.lstat(ckpt_path)
        if not stat.S_ISDIR(st.st_mode):
            raise ManifestError(f"{ckpt_path.name} is {safeio.kind(st.st_mode)}, not a "
                                "checkpoint directory: not followed")
        return safeio.read_limited(path, MAX_BYTES)
    except FileNotFoundError:
        raise ManifestError("no manifest.json (the save did not finish)") from None
    except safeio.UnsafeFile as e:
        raise ManifestError(f"manifest.json {e.strerror}") from None
    except OSError as e:
        raise ManifestError(f"cannot read manifest.json: {e.strerror}") from None


def load(ckpt_path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate the manifest's shape. Raises ManifestError with the reason.

    Opens nothing but a regular manifest.json of at most MAX_BYTES inside a real directory (no
    FIFO, device or link), and parses it with bounded nesting (`safeio.parse_json`).
    """
    return parse(_read(Path(ckpt_path)))


def parse(raw: bytes) -> dict[str, Any]:
    """The checks of `load` on manifest bytes read elsewhere (a mirror): bounded parsing, then
    the shape. The caller caps the size at MAX_BYTES before reading."""
    try:
        manifest = safeio.parse_object(raw, "manifest.json")
    except ValueError as e:
        raise ManifestError(str(e)) from None
    if manifest.get("format") != FORMAT:
        raise ManifestError(
            f"manifest.json is not an rtrain manifest (format {manifest.get('format')!r:.60})"
        )
    version = manifest.get("version")
    if version != VERSION:
        raise ManifestError(
            f"unknown format version {version!r:.30} (this rtrain reads {VERSION}): "
            "upgrade rtrain to read it"
        )
    for key, kind in REQUIRED.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise ManifestError(f"manifest.json field {key!r} is missing or of the wrong type")
    for key in _COUNTS:
        if not 0 <= manifest[key] <= _MAX_COUNT:
            raise ManifestError(f"manifest.json field {key!r} is out of range "
                                f"({str(manifest[key])[:30]})")
    if "run" in manifest and not runid.valid(manifest["run"]):
        raise ManifestError(f"manifest.json field 'run' is not a run identity "
                            f"({str(manifest['run'])[:40]!r})")
    for name, entry in manifest["files"].items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or isinstance(entry.get("size"), bool)
            or not 0 <= entry["size"] <= _MAX_COUNT
            or not isinstance(entry.get("hash"), str)
        ):
            raise ManifestError(f"manifest.json entry for {name!r} lacks a size or hash")
    return manifest
