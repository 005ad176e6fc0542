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

import mmap
import os
import stat

import blake3
import xxhash

from rtrain.checkpoint import safeio

XXH3 = "xxh3-128"
BLAKE3 = "blake3"
HASH_ALG = XXH3  # unsigned checkpoints
CRYPTOGRAPHIC = frozenset({BLAKE3})
SIGN_ALG = "blake3-keyed"
ENV_ALLOW_XXH3_SIGNED = "RTRAIN_ALLOW_XXH3_SIGNED"
"""`1`: under a key, accept signed manifests whose file hashes are xxh3 (an older rtrain's),
which a deliberate file swap could pass; refused otherwise."""
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


MAPPED = 1 << 20  # bytes: `hash_mapped` reads a file at least this large through a mapping


def hash_mapped(path: str | os.PathLike, alg: str = XXH3) -> str:
    """`hash_file`, reading through a mapping where the file is large: a file in memory (the
    memory tier's, in /dev/shm) is hashed in place, at half the cost of reading it into a
    buffer. Only for files no one truncates meanwhile (a mapping past a file's new end faults):
    rtrain's own, in an owner-only directory whose writer is gone."""
    with safeio.open_regular(path, buffering=0) as f:
        if os.fstat(f.fileno()).st_size < MAPPED:
            return hash_file(path, alg)
        h = new_hasher(alg)
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                for off in range(0, len(mm), _CHUNK):
                    h.update(view[off:off + _CHUNK])
            finally:
                view.release()
    return h.hexdigest()


def hash_file(path: str | os.PathLike, alg: str = XXH3) -> str:
    """Stream a file through `alg` with one reused buffer."""
    h = new_hasher(alg)
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

    Returns the derived 32-byte key, or None when signing is not configured. Like ssh with a
    private key, a key file that group or others may read or write is refused (anyone who can
    read it can sign forged checkpoints) unless RTRAIN_ALLOW_SHARED_KEY=1 says it is meant.
    """
    env = os.environ if env is None else env
    secret = env.get(ENV_SIGNING_KEY)
    if secret:
        return derive_key(secret.encode())
    key_file = env.get(ENV_SIGNING_KEY_FILE)
    if key_file:
        from rtrain.supervisor.core.errors import UsageError

        try:
            material = read_key_file(key_file, shared_ok=env.get(ENV_ALLOW_SHARED_KEY) == "1")
        except OSError as e:
            raise UsageError(
                f"cannot read the signing key file {key_file!r} ({e.strerror}): "
                f"fix {ENV_SIGNING_KEY_FILE} or unset it"
            ) from None
        if not material:
            raise UsageError(f"the signing key file {key_file!r} is empty: put a secret in it")
        return derive_key(material)
    return None


ENV_SIGNING_KEY = "RTRAIN_SIGNING_KEY"
"""A secret of any length that signs every manifest; a signed checkpoint that does not verify
under it is never loaded. Passed to the training process, never to hooks."""
ENV_SIGNING_KEY_FILE = "RTRAIN_SIGNING_KEY_FILE"
"""A file holding the signing key, instead of RTRAIN_SIGNING_KEY; refused when group or others
may access it (as ssh does)."""
ENV_ALLOW_SHARED_KEY = "RTRAIN_ALLOW_SHARED_KEY"
"""`1`: use a key file that group or others may access."""
ENV_ENCRYPTION_KEY = "RTRAIN_ENCRYPTION_KEY"  # read by checkpoint/crypt.py
"""Encrypt every checkpoint file at rest (AES-256-GCM): 64 hex digits, else a passphrase
(pip install 'rtrain[encrypt]'). Passed to the training process, never to hooks."""
SECRET_ENV = (ENV_SIGNING_KEY, ENV_ENCRYPTION_KEY)
"""Environment variables that hold a secret: kept from processes that neither sign nor
encrypt checkpoints (hooks)."""
_KEY_FILE_MAX = 1 << 20


def read_key_file(key_file: str, *, shared_ok: bool, what: str = "signing key file",
                  env_name: str = ENV_SIGNING_KEY_FILE) -> bytes:
    """A key file's stripped content; UsageError for one that is not a regular file, that
    group or others may access (unless `shared_ok`), or larger than 1 MiB."""
    from rtrain.supervisor.core.errors import UsageError

    # O_NONBLOCK: a FIFO put in the key file's place must not hang us; fstat of the descriptor
    # read from, so the mode checked is the mode of the bytes used.
    fd = os.open(key_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"the {what} {key_file!r} is not a regular file: fix {env_name}")
        if st.st_mode & 0o077 and not shared_ok:
            raise UsageError(
                f"the {what} {key_file!r} is accessible by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 it, or set "
                f"{ENV_ALLOW_SHARED_KEY}=1 to use it anyway")
        if st.st_size > _KEY_FILE_MAX:
            raise UsageError(f"the {what} {key_file!r} is larger than 1 MiB: a key "
                             "is a short secret")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(_KEY_FILE_MAX).strip()
    finally:
        os.close(fd)
