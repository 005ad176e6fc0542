"""Load a torch.distributed.checkpoint (DCP) directory without running code from it.

DCP's `FileSystemReader.read_metadata` is `pickle.load` of `.metadata`, and its default planner
`torch.load(weights_only=False)`s every non-tensor item: a checkpoint dir anyone could write to
would then run arbitrary code in training. Here:

- `.metadata` is unpickled by `_MetadataUnpickler`, which resolves only DCP's metadata classes
  (dataclasses and enums of `torch.distributed.checkpoint`), `torch.Size`, dtypes/layouts/memory
  formats and `pathlib` paths: constructing those runs no user code. Anything else is refused.
- non-tensor items are loaded with `torch.load(weights_only=True)` (DCP's tensors already are);
- every file DCP opens goes through `_VerifiedFS`: read once through `ListedFile` (listed in the
  manifest, a regular file, hashed while read and compared before DCP sees a byte). A shard file
  is held in memory while its items are copied out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import io
import os
import pathlib
import pickle
from collections.abc import Generator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from rtrain.checkpoint.verified_read import LoadError, open_listed, read_listed

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_OTHER = {("torch", "Size"): torch.Size,
          ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          ("pathlib", "PosixPath"): pathlib.PosixPath,
          ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
          ("collections", "OrderedDict"): collections.OrderedDict}
_MAX_METADATA = 1 << 30


def _allowed(module: str, name: str) -> Any:
    if (module, name) in _OTHER:
        return _OTHER[(module, name)]
    if module == "torch":
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
    if module in _DCP_MODULES:
        import importlib

        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise LoadError(f"dcp/.metadata refers to {module}.{name}, which is not part of DCP's "
                            "metadata: refused (rtrain never unpickles other objects; pass "
                            "restoring=Restoring(allow_pickle=True) only for a checkpoint you "
                            "trust)")
        return obj


def read_metadata(data: bytes) -> Metadata:
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except LoadError:
        raise
    except Exception as e:  # any malformed pickle: the reason, never a traceback
        raise LoadError(f"dcp/.metadata cannot be read ({type(e).__name__}: {str(e)[:200]})"
                        ) from None
    if not isinstance(md, Metadata):
        raise LoadError(f"dcp/.metadata holds a {type(md).__name__}, not DCP metadata")
    return md


class _VerifiedFS(FileSystem):
    """DCP's file system, reading only manifest-listed files, each verified as it is read."""

    def __init__(self, root: Path, manifest: dict[str, Any], alg: str, enc: Any) -> None:
        super().__init__()
        self.root, self.manifest, self.alg, self.enc = root, manifest, alg, enc

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str
                      ) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise LoadError(f"refusing to open {path} for writing while loading")
        name = os.path.relpath(path, self.root)
        with open_listed(self.root, name, self.manifest, self.alg, self.enc) as f:
            # Read straight into the stream's own buffer: one copy of a shard in memory.
            stream = io.BytesIO()
            if f.size:
                stream.seek(f.size - 1)
                stream.write(b"\0")
                with stream.getbuffer() as view:
                    f.readinto(view)
            f.finish()
        stream.seek(0)
        yield stream


class _SafeReader(dcp.FileSystemReader):
    def __init__(self, root: Path, sub: str, manifest: dict[str, Any], alg: str,
                 enc: Any) -> None:
        super().__init__(root / sub)
        self.fs = _VerifiedFS(root, manifest, alg, enc)
        self._root, self._manifest, self._alg, self._enc = root, manifest, alg, enc
        self._sub = sub
        self.refused: LoadError | None = None  # DCP hides a failed read behind its fallbacks

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = f"{self._sub}/.metadata" if rank is None else f"{self._sub}/__{rank}.metadata"
        try:
            md = read_metadata(read_listed(self._root, name, self._manifest, self._alg,
                                           limit=_MAX_METADATA, enc=self._enc))
        except LoadError as e:
            if self.refused is None:
                self.refused = e
            raise
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _SafePlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise LoadError(f"a non-tensor item of the sharded state ({read_item.dest_index.fqn})"
                            f" cannot be loaded safely: {str(e)[:200]}") from None
        # What DefaultLoadPlanner.load_bytes does with the object, minus its unpickling load.
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(sd: dict[str, Any], root: Path, sub: str, manifest: dict[str, Any], alg: str,
         group: Any, enc: Any = None) -> None:
    """`dcp.load(sd, ...)` from `root/sub`; LoadError for a checkpoint that cannot be trusted.
    Files of an encrypted checkpoint are decrypted with `enc` (`crypt.EncryptionKey`)."""
    reader = _SafeReader(root, sub, manifest, alg, enc)
    try:
        dcp.load(sd, storage_reader=reader, planner=_SafePlanner(), process_group=group)
    except (Exception, CheckpointException) as e:
        # DCP wraps each rank's error (and tries other metadata files after a failed read); a
        # refusal of ours anywhere means the checkpoint is bad, whatever DCP made of it.
        if reader.refused is not None:
            raise LoadError(str(reader.refused)) from None
        for exc, _ in getattr(e, "failures", {}).values():
            if isinstance(exc, LoadError):
                raise LoadError(str(exc)) from None
        raise
