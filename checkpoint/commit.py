"""The commit protocol (contract 3), torch-free.

Write every file into `.tmp-checkpoint-*`, fsync each, write `manifest.json` last, fsync it and
the temp dir, rename the temp dir to `checkpoint-<step>`, fsync the parent. A kill at any point
leaves either the previous checkpoints untouched plus a temp dir that is never loaded, or the
new checkpoint complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rtrain.checkpoint import crypt, encrypted_file, generation, runid, safetensors_io
from rtrain.checkpoint import manifest as mf
from rtrain.checkpoint.hashing import CRYPTOGRAPHIC, HASH_ALG, hash_file, new_hasher
from rtrain.checkpoint.layout import MANIFEST, checkpoint_name, tmp_name, trash_name
from rtrain.supervisor.core import filemode
from rtrain.supervisor.core.ownfiles import RefusedFile
from rtrain.supervisor.core.protocol import ENV_GENERATION


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_bytes(path: str | os.PathLike) -> int:
    return shutil.disk_usage(path).free


def remove_dir(path: Path) -> None:
    """Delete by renaming out of the way first, so no reader ever sees half a checkpoint."""
    trash = path.parent / trash_name(path.name)
    os.rename(path, trash)
    if trash.is_symlink() or not trash.is_dir():
        os.unlink(trash)  # an entry with a checkpoint's name that is no directory: never followed
    else:
        shutil.rmtree(trash, ignore_errors=True)


class PendingCheckpoint:
    """One checkpoint being written. Use `files`, then `commit()`; `abort()` on any error."""

    def __init__(self, ckpt_dir: str | os.PathLike, step: int, fsync: bool = True,
                 file_mode: int | None = None, hash_alg: str = HASH_ALG,
                 encryption: crypt.EncryptionKey | None = None) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.step = step
        self.fsync = fsync
        self.hash_alg = hash_alg  # hashing.alg_for(key): blake3 for a checkpoint to be signed
        self.encryption = encryption  # every file written encrypted (checkpoint/encrypted_file.py)
        # The run's file-mode policy (supervisor/core/filemode.py); None: RTRAIN_FILE_MODE or 0600.
        self.file_mode = filemode.from_env() if file_mode is None else file_mode
        filemode.make_dir(self.ckpt_dir, self.file_mode)
        self.tmp = self.ckpt_dir / tmp_name(step)
        os.mkdir(self.tmp, 0o700)  # nobody else looks in while it is written
        # The attempt this checkpoint belongs to; a forked writer keeps its parent's.
        self.generation: str | list[str] | None = os.environ.get(ENV_GENERATION) or None
        # The run writing the directory (checkpoint/runid.py), copied into the manifest.
        self.run = runid.read(self.ckpt_dir)
        self.files: dict[str, dict[str, Any]] = {}
        self.tensors: dict[str, dict[str, list]] = {}

    @classmethod
    def adopt(cls, ckpt_dir: str | os.PathLike, step: int, tmp: str | os.PathLike,
              fsync: bool = True, hash_alg: str = HASH_ALG,
              encryption: crypt.EncryptionKey | None = None) -> PendingCheckpoint:
        """Write into a temp dir another process created (a rank other than 0 of a
        distributed save); such a writer never commits, it reports its `files` to the one
        that does."""
        self = cls.__new__(cls)
        self.ckpt_dir, self.step, self.fsync = Path(ckpt_dir), step, fsync
        self.hash_alg, self.encryption = hash_alg, encryption
        self.tmp, self.file_mode = Path(tmp), filemode.from_env()
        self.files, self.tensors = {}, {}
        self.generation = os.environ.get(ENV_GENERATION) or None
        self.run = None  # never commits
        return self

    def add_file(self, name: str, size: int, hash: str,
                 tensors: dict[str, list] | None = None) -> None:
        """List a file written into the temp dir by someone else (another rank, a DCP
        writer), with its size and content hash."""
        self.files[name] = {"size": size, "hash": hash}
        if tensors:
            self.tensors[name] = tensors

    def seal_file(self, name: str) -> tuple[int, str]:
        """Encrypt, in place, a file someone else wrote into the temp dir (a DCP shard) when
        this checkpoint is encrypted; returns its size and content hash as it now is."""
        path = self.tmp / name
        if self.encryption is None:
            return path.stat().st_size, hash_file(path, self.hash_alg)
        h = new_hasher(self.hash_alg)
        tmp = path.with_name(path.name + ".sealing")
        with open(path, "rb", buffering=0) as src, open(tmp, "xb", buffering=0) as dst:
            def emit(view: memoryview) -> None:
                h.update(view)
                dst.write(view)

            enc = encrypted_file.Encryptor(self.encryption, name, emit)
            try:
                for piece in iter(lambda: src.read(encrypted_file.CHUNK), b""):
                    enc.update(piece)
                enc.finish()
            finally:
                enc.close()
            if self.fsync:
                os.fsync(dst.fileno())
            size = os.fstat(dst.fileno()).st_size
        os.replace(tmp, path)  # the plaintext never reaches the committed checkpoint
        return size, h.hexdigest()

    def write_tensors(self, name: str, blobs: Iterable[safetensors_io.TensorBlob],
                      metadata: dict[str, str] | None = None) -> None:
        blobs = list(blobs)
        seal = None if self.encryption is None else (self.encryption, name)
        w = safetensors_io.write_file(self.tmp / name, blobs, metadata=metadata,
                                      fsync=self.fsync, hash_alg=self.hash_alg, seal=seal)
        self.files[name] = {"size": w.size, "hash": w.hash}
        self.tensors[name] = {b.name: [b.dtype, list(b.shape)] for b in blobs}

    def write_json(self, name: str, obj: Any) -> None:
        data = json.dumps(obj, sort_keys=True).encode()
        self.write_bytes(name, data)

    def write_bytes(self, name: str, data: bytes) -> None:
        if self.encryption is not None:
            data = encrypted_file.seal_bytes(self.encryption, name, data)
        h = new_hasher(self.hash_alg)
        h.update(data)
        with open(self.tmp / name, "xb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        self.files[name] = {"size": len(data), "hash": h.hexdigest()}

    def commit(self, fields: dict[str, Any], key: bytes | None = None) -> Path:
        """Write the manifest and rename into place. Returns the committed path.

        Raises generation.StaleWriter (the temp dir removed) when the run moved on to a newer
        attempt since this checkpoint was started."""
        if key is not None and self.hash_alg not in CRYPTOGRAPHIC:
            # A signature over non-cryptographic file hashes would not protect the files.
            raise ValueError(f"a signed checkpoint needs cryptographic file hashes: create it "
                             f"with hash_alg=alg_for(key), not {self.hash_alg!r}")
        m = {
            "format": mf.FORMAT,
            "version": mf.VERSION,
            "step": self.step,
            "created": time.time(),
            "hash_alg": self.hash_alg,
            **fields,
            "files": self.files,
            "tensors": self.tensors,
        }
        if self.run is not None:
            m["run"] = self.run
        if self.encryption is not None:
            m["encryption"] = crypt.manifest_entry(self.encryption, encrypted_file.CHUNK)
            if self.encryption.hide_tensors:
                del m["tensors"]  # names and shapes stay inside the encrypted files
        if key is not None:
            mf.sign_manifest(m, key)
        with open(self.tmp / MANIFEST, "xb") as f:
            f.write(mf.dumps(m))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        filemode.apply_tree(self.tmp, self.file_mode)
        if self.fsync:
            fsync_dir(self.tmp)
        final = self.ckpt_dir / checkpoint_name(self.step)
        try:
            with generation.committing(self.ckpt_dir, self.generation, final.name):
                if os.path.lexists(final):  # a link (even a dangling one) is replaced, not followed
                    # A step saved again (a replay after resume, or after a rollback): move the
                    # old one aside first; until the rename below, resume falls back to the
                    # previous checkpoint.
                    remove_dir(final)
                os.rename(self.tmp, final)
                if self.fsync:
                    fsync_dir(self.ckpt_dir)
        except (generation.StaleWriter, RefusedFile):  # RefusedFile: a FIFO at the token's name
            self.abort()
            raise
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
