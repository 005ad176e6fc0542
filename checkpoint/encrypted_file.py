"""The encrypted file format: a checkpoint file as chunked AES-256-GCM (`checkpoint/crypt.py`
holds the key).

    header   56 bytes: magic b"RTRNCRYP", version u8 (1), cipher u8 (1: AES-256-GCM), 2 reserved,
             chunk_size u32 (little-endian), key id (the key fingerprint, 8 bytes), salt (32
             random bytes)
    chunk i  AES-256-GCM(plaintext[i*chunk_size : (i+1)*chunk_size]) + 16-byte tag

- Keys: each file has its own AES key, `BLAKE3(salt, key=file-key root)`, the root derived from
  the user's key; the nonce of chunk i is i (96-bit big-endian counter). A (key, nonce) pair
  never repeats: the salt is 256 random bits per file and the counter grows within one file.
- Order and end: chunk i's associated data is the header, the file's name in the checkpoint
  and (i, final). Moving a chunk changes its nonce and AAD, so the tag fails; every chunk but the
  last is full and the last is shorter (empty when the plaintext fills whole chunks) and marked
  final, so cutting the file at a chunk boundary, or anywhere, is caught; a file renamed within
  the checkpoint fails too.
- Hashes: the manifest's sizes and hashes are of these bytes (the ciphertext), so verification,
  resume selection and copies need no key; the plaintext is authenticated by the tags.

The plaintext size follows from the file size (`plain_size`), so a reader knows the size of
what it will decrypt before reading it.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rtrain.checkpoint.crypt import CryptError, EncryptionKey, cipher

CHUNK = 4 << 20
"""4 MiB: divides the writer's 32 MiB write-back chunks and is the reader's chunk; a chunk just
sealed is hashed and written while still in cache (measured: 2.2 GB/s sealing at 4 MiB against
1.97 at 32 MiB). The tag costs 16 bytes a chunk (4 ppm)."""
MAX_CHUNK = 64 << 20
"""Largest chunk a reader accepts: the header is read before the file is trusted, and the
chunk size is what a reader allocates."""
TAG = 16
MAGIC = b"RTRNCRYP"
_HEADER = struct.Struct("<8sBBHI8s32s")
HEADER_SIZE = _HEADER.size
_VERSION, _AES_256_GCM = 1, 1
_AHEAD = 2  # chunks sealed ahead of the one being hashed and written


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


def _aad(header: bytes, name: str, i: int, final: bool) -> bytes:
    return b"".join((header, name.encode(), struct.pack("<QB", i, final)))


def plain_size(file_size: int, chunk_size: int) -> int | None:
    """The plaintext size of an encrypted file of `file_size` bytes; None if no file has it."""
    body = file_size - HEADER_SIZE
    if body < TAG:
        return None
    full, rest = divmod(body, chunk_size + TAG)
    return None if rest < TAG else full * chunk_size + rest - TAG


def sealed_size(plain: int, chunk_size: int = CHUNK) -> int:
    full, rest = divmod(plain, chunk_size)
    return HEADER_SIZE + full * (chunk_size + TAG) + rest + TAG


class Encryptor:
    """Seal a stream written in pieces of any size; `emit` gets the encrypted file's bytes, in
    order (the header first, then each sealed chunk).

    Chunks are sealed one thread ahead of `emit` (the caller hashes and writes them), so with
    two cores sealing overlaps the write. Pieces of at least a chunk are sealed where they lie
    (no copy), so the caller's memory must stay unchanged until `finish()` returns.
    """

    def __init__(self, key: EncryptionKey, name: str, emit: Callable[[memoryview], None],
                 chunk_size: int = CHUNK) -> None:
        salt = os.urandom(32)
        self.header = _HEADER.pack(MAGIC, _VERSION, _AES_256_GCM, 0, chunk_size,
                                   bytes.fromhex(key.fingerprint), salt)
        self._aead = cipher()(key.file_key(salt))
        self._name, self._emit, self._chunk = name, emit, chunk_size
        self._stage: bytearray | None = None
        self._filled = 0
        self._index = 0
        self._pending: deque[tuple[Future, bytearray, int, bytearray | None]] = deque()
        self._free_out: list[bytearray] = []
        self._free_stage: list[bytearray] = []
        self._pool: ThreadPoolExecutor | None = None
        emit(memoryview(self.header))

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n, i, c = view.nbytes, 0, self._chunk
        if self._filled:
            take = min(c - self._filled, n)
            assert self._stage is not None
            self._stage[self._filled:self._filled + take] = view[:take]
            self._filled += take
            i = take
            if self._filled == c:
                stage, self._stage, self._filled = self._stage, None, 0
                self._submit(memoryview(stage), final=False, stage=stage)
        while n - i >= c:
            self._submit(view[i:i + c], final=False)
            i += c
        if i < n:
            self._stage = self._free_stage.pop() if self._free_stage else bytearray(c)
            self._stage[:n - i] = view[i:]
            self._filled = n - i

    def finish(self) -> None:
        """Seal the final chunk (shorter than a chunk, possibly empty) and emit everything."""
        try:
            last = memoryview(self._stage)[:self._filled] if self._stage is not None else b""
            self._submit(memoryview(last), final=True, stage=self._stage)
            self._stage, self._filled = None, 0
            while self._pending:
                self._emit_oldest()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the sealing thread (after an error: nothing more is emitted)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _submit(self, plain: memoryview, *, final: bool, stage: bytearray | None = None) -> None:
        size = plain.nbytes + TAG
        out = self._free_out.pop() if self._free_out else bytearray(self._chunk + TAG)
        i = self._index
        self._index += 1
        aad = _aad(self.header, self._name, i, final)
        if final and not self._pending:
            # A file of one chunk (state.json, a small tensor file): no thread for it.
            done: Future = Future()
            self._aead.encrypt_into(_nonce(i), plain, aad, memoryview(out)[:size])
            done.set_result(None)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="rtrain-seal")
            done = self._pool.submit(self._aead.encrypt_into, _nonce(i), plain, aad,
                                     memoryview(out)[:size])
        self._pending.append((done, out, size, stage))
        while len(self._pending) > _AHEAD:
            self._emit_oldest()

    def _emit_oldest(self) -> None:
        done, out, size, stage = self._pending.popleft()
        done.result()
        self._emit(memoryview(out)[:size])
        self._free_out.append(out)
        if stage is not None:
            self._free_stage.append(stage)


def seal_bytes(key: EncryptionKey, name: str, data: bytes, chunk_size: int = CHUNK) -> bytes:
    """The encrypted file of a small plaintext (state.json), in memory."""
    parts: list[bytes] = []
    enc = Encryptor(key, name, lambda v: parts.append(bytes(v)), chunk_size)
    enc.update(data)
    enc.finish()
    return b"".join(parts)


class Decryptor:
    """Read an encrypted file through `raw`, a reader of its bytes in order (`ListedFile`:
    hashed as read, `size`, `readinto`, `read`, `finish`, `close`), with the same interface
    for the plaintext. Each chunk is authenticated before its bytes are returned; `finish()`
    also checks that the final chunk was there and then `raw.finish()` (the file's hash).
    Raises CryptError with the reason."""

    def __init__(self, raw: Any, key: EncryptionKey, name: str) -> None:
        self.raw, self.name = raw, name
        if raw.size < HEADER_SIZE:
            raise CryptError(f"{name}: too short for an encrypted file ({raw.size} bytes)")
        self.header = raw.read(HEADER_SIZE)
        magic, version, alg, _, chunk, key_id, salt = _HEADER.unpack(self.header)
        if magic != MAGIC:
            raise CryptError(f"{name}: not an encrypted file, though the manifest says the "
                             "checkpoint is encrypted")
        if version != _VERSION or alg != _AES_256_GCM:
            raise CryptError(f"{name}: encrypted file version {version} cipher {alg}, which "
                             "this rtrain does not read: upgrade rtrain")
        if key_id.hex() != key.fingerprint:
            raise CryptError(f"{name}: encrypted with the key of fingerprint {key_id.hex()}, "
                             f"not {key.fingerprint}")
        if not 0 < chunk <= MAX_CHUNK:
            raise CryptError(f"{name}: chunk size {chunk} in its header is out of range")
        size = plain_size(raw.size, chunk)
        if size is None:
            raise CryptError(f"{name}: its length ({raw.size} bytes) is no encrypted file's: "
                             "truncated or extended")
        self.size, self.pos, self._chunk = size, 0, chunk
        self._last = size // chunk  # the index of the final chunk
        self._aead = cipher()(key.file_key(salt))
        from cryptography.exceptions import InvalidTag

        self._invalid_tag = InvalidTag
        self._sealed = bytearray(min(chunk, size) + TAG)
        self._plain = bytearray(min(chunk, size))
        self._next = 0  # the next chunk to open
        self._have = memoryview(b"")  # opened plaintext not yet returned

    def __enter__(self) -> Decryptor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.raw.close()

    def _length(self, i: int) -> int:
        return self._chunk if i < self._last else self.size - self._last * self._chunk

    def _open(self, out: memoryview) -> None:
        sealed = memoryview(self._sealed)[:out.nbytes + TAG]
        self.raw.readinto(sealed)
        self._decrypt(self._next, sealed, out)
        self._next += 1

    def _decrypt(self, i: int, sealed: memoryview, out: memoryview) -> None:
        try:
            self._aead.decrypt_into(_nonce(i), sealed, _aad(self.header, self.name, i,
                                                              i == self._last), out)
        except self._invalid_tag:
            raise CryptError(f"{self.name}: chunk {i} fails authentication: the file was "
                             "altered (tampered with, corrupted, or its chunks moved)") from None

    def _open_run(self, out: memoryview) -> None:
        """Open whole chunks into `out` (exactly their plaintext): each chunk's ciphertext is
        read and hashed here while a thread decrypts the one before into its place (read and
        hash on one core, AES on the other)."""
        free = [self._sealed, bytearray(len(self._sealed))]
        pending: deque[tuple[Future, bytearray]] = deque()
        pool = ThreadPoolExecutor(1, thread_name_prefix="rtrain-open")
        try:
            off = 0
            while off < out.nbytes:
                i = self._next
                length = self._length(i)
                if not free:
                    done, buf = pending.popleft()
                    done.result()
                    free.append(buf)
                buf = free.pop()
                sealed = memoryview(buf)[:length + TAG]
                self.raw.readinto(sealed)
                pending.append((pool.submit(self._decrypt, i, sealed, out[off:off + length]),
                                buf))
                self._next += 1
                off += length
            while pending:
                pending.popleft()[0].result()
        finally:
            # Nothing may still write into `out` once this returns or raises.
            pool.shutdown(wait=True, cancel_futures=True)

    def readinto(self, buf: memoryview) -> None:
        view = buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
        n = view.nbytes
        if self.pos + n > self.size:
            raise CryptError(f"{self.name}: reading past the end ({self.pos} + {n} of "
                             f"{self.size} bytes)")
        off = 0
        while off < n:
            if self._have.nbytes:
                take = min(self._have.nbytes, n - off)
                view[off:off + take] = self._have[:take]
                self._have = self._have[take:]
                off += take
                continue
            length = self._length(self._next)
            whole = self._whole_chunks(n - off)
            if whole >= 2 * self._chunk:  # many chunks: read ahead of the decryption
                self._open_run(view[off:off + whole])
                off += whole
            elif n - off >= length:  # a whole chunk wanted: straight into the caller's memory
                self._open(view[off:off + length])
                off += length
            else:
                self._open(memoryview(self._plain)[:length])
                self._have = memoryview(self._plain)[:length]
        self.pos += n

    def _whole_chunks(self, n: int) -> int:
        """How many of the next `n` plaintext bytes are whole chunks, as a byte count (the
        final chunk counts when `n` reaches the end of the file)."""
        full = min(n // self._chunk, self._last - self._next)
        total = full * self._chunk
        if self._next + full == self._last and n - total >= self._length(self._last):
            total += self._length(self._last)
        return total

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        self.readinto(memoryview(buf))
        return bytes(buf)

    def finish(self) -> None:
        if self.pos != self.size:
            raise CryptError(f"{self.name}: read {self.pos} of {self.size} bytes")
        if self._next == self._last:  # an empty final chunk: authenticate it too
            self._open(memoryview(bytearray(0)))
        self.raw.finish()
