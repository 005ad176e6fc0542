"""The manifest: the one file that makes a checkpoint exist (contract 3).

Schema (version 1), a JSON object:

    format        "rtrain-checkpoint"
    version       1
    step          int, the step to run next after restoring
    epoch         int
    samples_seen  int, samples consumed since the start of training
    created       float, unix time of the commit
    files         {relative path: {"size": int, "hash": str}}      every file but the manifest
    hash_alg      "xxh3-128"
    tensors       {relative path: {tensor name: [dtype, shape]}}   safetensors contents
    fingerprint   str, hash of the model's (name, shape, dtype) list
    environment   {"python", "torch", "cuda", "device", "rtrain", "host"}
    settings      {knob: value} in force (RTRAIN_SETTINGS)
    metrics       {name: number}
    info          {free-form facts: trainable_only, frozen_fingerprint, world_size, ...}
    signature     optional {"alg": "blake3-keyed", "value": hex} over the canonical rest
"""

from __future__ import annotations

import hmac
import json
import math
from pathlib import Path
from typing import Any

from supervisor.ckpt import hashing
from supervisor.ckpt.layout import MANIFEST

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


def load(ckpt_path: str | Path) -> dict[str, Any]:
    """Read and validate the manifest's shape. Raises ManifestError with the reason."""
    path = Path(ckpt_path) / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError("no manifest.json (the save did not finish)") from None
    except OSError as e:
        raise ManifestError(f"cannot read manifest.json: {e.strerror}") from None
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest.json is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise ManifestError("manifest.json is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ManifestError(
            f"manifest.json is not an rtrain manifest (format {manifest.get('format')!r})"
        )
    version = manifest.get("version")
    if version != VERSION:
        raise ManifestError(
            f"unknown format version {version!r} (this rtrain reads {VERSION}): "
            "upgrade rtrain to read it"
        )
    for key, kind in REQUIRED.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest.get(key), bool):
            raise ManifestError(f"manifest.json field {key!r} is missing or of the wrong type")
    for name, entry in manifest["files"].items():
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("size"), int)
            or not isinstance(entry.get("hash"), str)
        ):
            raise ManifestError(f"manifest.json entry for {name!r} lacks a size or hash")
    return manifest
