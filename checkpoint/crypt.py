"""Encryption at rest: the key checkpoints are sealed with, its fingerprint, and the manifest's
record of it. The file format itself is `checkpoint/encrypted_file.py`.

The key (`load_encryption_key`): `RTRAIN_ENCRYPTION_KEY` or `RTRAIN_ENCRYPTION_KEY_FILE`. 64 hex
digits are the 32-byte key itself; anything else is a passphrase stretched with scrypt (N=2^15,
r=8, p=1: ~0.1 s and 32 MiB once per process), because a passphrase may be guessable and
ciphertext can be attacked offline. Its salt is fixed (the key must be known before any file
exists); scrypt's cost is what makes guessing expensive. Each file gets its own AES key from
this one and the file's random salt (`EncryptionKey.file_key`). The fingerprint (16 hex digits
of a BLAKE3 derivation) names a key in manifests, file headers and messages and reveals
nothing of it.

The manifest's `encryption` field says a checkpoint is encrypted, how, and under which key
(`manifest_entry`); `key_problem` is the one-line reason a given key cannot open one.

Torch-free. `cryptography` (the `rtrain[encrypt]` extra) is imported only by `cipher()`, i.e.
when a key is configured or an encrypted file is read or written.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from typing import Any

import blake3

from rtrain.checkpoint import hashing
from rtrain.checkpoint.verified_read import LoadError

SCHEME = "aes-256-gcm-chunked-v1"
_SCRYPT = {"n": 1 << 15, "r": 8, "p": 1, "maxmem": 64 << 20}
_SCRYPT_SALT = b"rtrain checkpoint encryption key v1"
_FILE_KEYS = "rtrain checkpoint encryption v1 file keys"
_FINGERPRINT = "rtrain checkpoint encryption v1 key fingerprint"
ENV_KEY = hashing.ENV_ENCRYPTION_KEY
ENV_KEY_FILE = "RTRAIN_ENCRYPTION_KEY_FILE"
"""A file holding the encryption key, instead of RTRAIN_ENCRYPTION_KEY (the signing key file's
mode rules apply)."""
ENV_HIDE_TENSORS = "RTRAIN_ENCRYPT_METADATA"
"""`1`: encrypted checkpoints also leave tensor names and shapes out of their manifest."""
INSTALL_HINT = "pip install 'rtrain[encrypt]'"


class CryptError(LoadError):
    """An encrypted file that cannot be opened: tampered, truncated, or not one at all; to a
    loader, a file that does not match its manifest (a bad checkpoint)."""


class MissingCipher(RuntimeError):
    """A key is configured but the `cryptography` package is not installed."""


@dataclass(frozen=True)
class EncryptionKey:
    """The 32-byte key and its public fingerprint. repr() never shows the key."""

    key: bytes = field(repr=False)
    hide_tensors: bool = False
    """RTRAIN_ENCRYPT_METADATA=1: leave tensor names and shapes out of the manifest."""

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ValueError("an encryption key is 32 bytes (64 hex digits)")

    @classmethod
    def from_material(cls, material: bytes | str, hide_tensors: bool = False
                      ) -> EncryptionKey:
        """64 hex digits: the key itself; anything else: a passphrase (scrypt)."""
        text = material if isinstance(material, str) else material.decode("utf-8", "replace")
        text = text.strip()
        if re.fullmatch(r"[0-9a-fA-F]{64}", text):
            return cls(bytes.fromhex(text), hide_tensors)
        raw = material.encode() if isinstance(material, str) else material
        return cls(hashlib.scrypt(raw.strip(), salt=_SCRYPT_SALT, dklen=32, **_SCRYPT),
                   hide_tensors)

    @property
    def fingerprint(self) -> str:
        return blake3.blake3(self.key, derive_key_context=_FINGERPRINT).hexdigest()[:16]

    def file_key(self, salt: bytes) -> bytes:
        root = blake3.blake3(self.key, derive_key_context=_FILE_KEYS).digest()
        return blake3.blake3(salt, key=root).digest()


def load_encryption_key(env: dict[str, str] | None = None) -> EncryptionKey | None:
    """The key from RTRAIN_ENCRYPTION_KEY or RTRAIN_ENCRYPTION_KEY_FILE; None when unset.

    The key file follows the signing key file's rules (regular, at most 1 MiB, not readable by
    group or others unless RTRAIN_ALLOW_SHARED_KEY=1). Raises UsageError saying what to fix.
    """
    from rtrain.supervisor.core.errors import UsageError

    env = os.environ if env is None else env
    hide = env.get(ENV_HIDE_TENSORS) == "1"
    secret = env.get(ENV_KEY)
    if secret:
        return EncryptionKey.from_material(secret, hide)
    key_file = env.get(ENV_KEY_FILE)
    if not key_file:
        return None
    try:
        material = hashing.read_key_file(
            key_file, shared_ok=env.get(hashing.ENV_ALLOW_SHARED_KEY) == "1",
            what="encryption key file", env_name=ENV_KEY_FILE)
    except OSError as e:
        raise UsageError(f"cannot read the encryption key file {key_file!r} ({e.strerror}): "
                         f"fix {ENV_KEY_FILE} or unset it") from None
    if not material:
        raise UsageError(f"the encryption key file {key_file!r} is empty: put a key in it")
    return EncryptionKey.from_material(material, hide)


def cipher() -> Any:
    """The AESGCM class, imported on first use; MissingCipher names the package to install."""
    try:
        from cryptography.exceptions import InvalidTag  # noqa: F401 (imported before any fork)
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise MissingCipher(f"checkpoint encryption needs the cryptography package: "
                            f"{INSTALL_HINT}") from None
    return AESGCM


# ---------------------------------------------------------------- the manifest's record


def manifest_entry(key: EncryptionKey, chunk_size: int) -> dict[str, Any]:
    """The manifest's `encryption` field: how its files are sealed, and by which key."""
    entry: dict[str, Any] = {"scheme": SCHEME, "key_fingerprint": key.fingerprint,
                             "chunk_size": chunk_size}
    if key.hide_tensors:
        entry["tensors_listed"] = False
    return entry


def scheme_of(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's `encryption` field, checked; None for a plaintext checkpoint."""
    entry = manifest.get("encryption")
    if entry is None:
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("key_fingerprint"), str):
        raise CryptError("the manifest's encryption field is not a map with a key_fingerprint")
    if entry.get("scheme") != SCHEME:
        raise CryptError(f"encrypted with scheme {str(entry.get('scheme'))[:40]!r}, which this "
                         f"rtrain does not know (it reads {SCHEME!r}): upgrade rtrain")
    return entry


def key_problem(manifest: dict[str, Any], key: EncryptionKey | None) -> str | None:
    """Why `key` cannot open this checkpoint (one line naming both fingerprints); None when it
    can, or when the checkpoint is not encrypted."""
    entry = scheme_of(manifest)
    if entry is None:
        return None
    wanted = entry["key_fingerprint"][:32]
    if key is None:
        return (f"encrypted with the key of fingerprint {wanted}, and no key is given: set "
                f"{ENV_KEY} or {ENV_KEY_FILE} to that key")
    if key.fingerprint != wanted:
        return (f"encrypted with the key of fingerprint {wanted}, but the key given has "
                f"fingerprint {key.fingerprint}: set {ENV_KEY} or {ENV_KEY_FILE} to the key "
                "the checkpoint was saved with")
    return None
