"""Encrypted sharded (DCP) checkpoints under a real process group (gloo, world size 1): DCP's
shards and metadata are sealed like every other file, and load back through the verified,
decrypting reader."""

from __future__ import annotations

import json

import pytest
import torch
from hostile import make, relist, two_checkpoints

import rtrain
from rtrain.checkpoint import crypt, encrypted_file
from rtrain.checkpoint.verify import verify
from rtrain.supervisor.core.errors import CorruptCheckpoint, KeyMismatch

pytestmark = pytest.mark.skipif(not torch.distributed.is_available()
                                or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")
KEY = "7e" * 32


def restore(ckpt_dir, path=None, allow_pickle=False, **kw):
    model, opt = make(7)
    step = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir,
                               saving=rtrain.Saving(sharded=True),
                               restoring=rtrain.Restoring(allow_pickle=allow_pickle),
                               **kw).restore(path)
    return step, model, opt


def test_sharded_files_are_sealed_and_load_with_the_key(gloo_group, tmp_path):
    weights, _ = two_checkpoints(tmp_path / "ckpt", saving=rtrain.Saving(sharded=True),
                                 encryption_key=KEY)
    path = tmp_path / "ckpt" / "checkpoint-4"
    m = json.loads((path / "manifest.json").read_text())
    assert m["encryption"]["key_fingerprint"] == crypt.EncryptionKey.from_material(KEY
                                                                                   ).fingerprint
    dcp_files = [n for n in m["files"] if n.startswith("dcp/")]
    assert "dcp/.metadata" in dcp_files and len(dcp_files) >= 2
    for name in m["files"]:
        assert (path / name).read_bytes().startswith(encrypted_file.MAGIC), name
    assert not list(path.rglob("*.sealing"))
    assert verify(path, "full").ok
    step, model, _ = restore(tmp_path / "ckpt", encryption_key=KEY)
    assert step == 4 and torch.equal(model.weight, weights[4])


def test_sharded_without_the_key_or_tampered_is_refused(gloo_group, tmp_path):
    two_checkpoints(tmp_path / "ckpt", saving=rtrain.Saving(sharded=True), encryption_key=KEY)
    path = tmp_path / "ckpt" / "checkpoint-4"
    with pytest.raises(KeyMismatch, match="fingerprint"):
        restore(tmp_path / "ckpt")
    with pytest.raises(CorruptCheckpoint, match="cannot read encrypted files"):
        restore(tmp_path / "ckpt", path, encryption_key=KEY, allow_pickle=True)
    shard = next(n for n in json.loads((path / "manifest.json").read_text())["files"]
                 if n.endswith(".distcp"))
    data = bytearray((path / shard).read_bytes())
    data[encrypted_file.HEADER_SIZE + 1] ^= 1
    relist(path, shard, bytes(data))  # the manifest's hash made to match
    with pytest.raises(CorruptCheckpoint, match="fails authentication"):
        restore(tmp_path / "ckpt", path, encryption_key=KEY)
