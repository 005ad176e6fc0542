"""Content hashes of checkpoint files and keyed signatures of manifests.

File hashes (`hash_alg` in the manifest):
- `xxh3-128` for unsigned checkpoints: ~27 GB/s a core, so full verification is bound by
  reading. It detects accidents (bit rot, truncation, a copy gone wrong), not an attacker: a
  file with the same xxh3 can be built on purpose.
- `blake3` when a signing key is configured: the signature covers the manifest, and the
  manifest's file hashes must then be cryptographic or the signature protects nothing.

A signed manifest whose file hashes are not cryptographic (checkpoints signed before `blake3`
was used) is refused while a key is configured, unless `RTRAIN_ALLOW_XXH3_SIGNED=1` says to
trust them (a warning is logged each time).

Signatures: BLAKE3 in keyed mode, a cryptographic MAC, over the canonical manifest.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import xxhash

XXH3 = "xxh3-128"
BLAKE3 = "blake3"
HASH_ALG = XXH3  # unsigned checkpoints
CRYPTOGRAPHIC = frozenset({BLAKE3})
SIGN_ALG = "blake3-keyed"
ENV_ALLOW_XXH3_SIGNED = "RTRAIN_ALLOW_XXH3_SIGNED"
_CHUNK = 16 << 20
_KEY_CONTEXT = "rtrain checkpoint manifest signing v1"


class HashAlgError(ValueError):
    """A manifest's `hash_alg` that cannot be used; str() is the reason a person reads."""


def alg_for(key: bytes | None) -> str:
    """The file hash a new checkpoint gets: cryptographic when it will be signed."""
    return BLAKE3 if key is not None else XXH3


def manifest_alg(manifest: dict, key: bytes | None,
                 env: dict[str, str] | None = None) -> str:
    """The `hash_alg` of a manifest, checked: known, and cryptographic when a key is set."""
    alg = manifest.get("hash_alg", XXH3)  # manifests before the field existed used xxh3
    if alg not in (XXH3, BLAKE3):
        raise HashAlgError(f"unknown file hash algorithm {alg!r} (this rtrain knows {XXH3!r} "
                           f"and {BLAKE3!r}): upgrade rtrain to read it")
    if key is None or alg in CRYPTOGRAPHIC:
        return alg
    env = os.environ if env is None else env
    if env.get(ENV_ALLOW_XXH3_SIGNED) == "1":
        import logging  # only here: `rtrain inspect` starts without it

        logging.getLogger(__name__).warning(
            "trusting a signed manifest whose file hashes are %s (not cryptographic) because "
            "%s=1: its files could have been replaced", alg, ENV_ALLOW_XXH3_SIGNED)
        return alg
    raise HashAlgError(f"signed, but its file hashes are {alg} (not cryptographic: a file "
                       "can be replaced without changing its hash); rtrain signs with "
                       f"{BLAKE3} file hashes. Set {ENV_ALLOW_XXH3_SIGNED}=1 to trust such "
                       "checkpoints anyway (e.g. ones signed by an older rtrain)")


def new_hasher(alg: str = XXH3):
    if alg == BLAKE3:
        # Threads pay off only for large updates; blake3 uses them per call when worth it.
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if alg == XXH3:
        return xxhash.xxh3_128()
    raise HashAlgError(f"unknown file hash algorithm {alg!r}")


def hash_file(path: str | os.PathLike, alg: str = XXH3) -> str:
    """Stream a file through `alg` with one reused buffer."""
    h = new_hasher(alg)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def derive_key(material: bytes) -> bytes:
    """Any length of user key material becomes a 32-byte BLAKE3 key."""
    return blake3.blake3(material, derive_key_context=_KEY_CONTEXT).digest()


def sign(data: bytes, key: bytes) -> str:
    return blake3.blake3(data, key=key).hexdigest()


def load_signing_key(env: dict[str, str] | None = None) -> bytes | None:
    """The signing key from `RTRAIN_SIGNING_KEY` (the secret itself) or `RTRAIN_SIGNING_KEY_FILE`.

    Returns the derived 32-byte key, or None when signing is not configured.
    """
    env = os.environ if env is None else env
    secret = env.get("RTRAIN_SIGNING_KEY")
    if secret:
        return derive_key(secret.encode())
    key_file = env.get("RTRAIN_SIGNING_KEY_FILE")
    if key_file:
        from supervisor.errors import UsageError

        try:
            material = Path(key_file).read_bytes().strip()
        except OSError as e:
            raise UsageError(
                f"cannot read the signing key file {key_file!r} ({e.strerror}): "
                "fix RTRAIN_SIGNING_KEY_FILE or unset it"
            ) from None
        if not material:
            raise UsageError(f"the signing key file {key_file!r} is empty: put a secret in it")
        return derive_key(material)
    return None
