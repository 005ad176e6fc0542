"""Content hashes (xxh3-128: ~27 GB/s a core, so full verification is bound by reading) and
keyed signatures (BLAKE3 in keyed mode, a cryptographic MAC)."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import xxhash

from supervisor.ckpt import safeio

HASH_ALG = "xxh3-128"
SIGN_ALG = "blake3-keyed"
_CHUNK = 16 << 20
_KEY_CONTEXT = "rtrain checkpoint manifest signing v1"


def new_hasher() -> xxhash.xxh3_128:
    return xxhash.xxh3_128()


def hash_file(path: str | os.PathLike) -> str:
    """Stream a file through xxh3-128 with one reused buffer."""
    h = xxhash.xxh3_128()
    # Links were checked by the caller (verify.check_member_name); a FIFO must not hang us.
    with safeio.open_regular(path, follow_symlinks=True, buffering=0) as f:
        # Sized to the file: zeroing 16 MiB for a 1 KiB state.json costs more than hashing it.
        buf = bytearray(max(1, min(_CHUNK, os.fstat(f.fileno()).st_size + 1)))
        view = memoryview(buf)
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
