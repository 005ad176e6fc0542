"""Restore reads each file into one buffer, large reads ahead of the hash on reader threads:
the guarantees of the one hashed read hold on that path, and fresh memory is cheap to fill."""

import os
import resource
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import rtrain
from rtrain.checkpoint import hashing
from rtrain.checkpoint.safetensors_io import read_header
from rtrain.checkpoint.verified_read import _PARALLEL_FROM, ListedFile, LoadError
from rtrain.supervisor.core.errors import CorruptCheckpoint

BIG = _PARALLEL_FROM + (5 << 20) + 123  # over the threshold, not a whole number of chunks


pytestmark = pytest.mark.usefixtures("unsupervised")


def listed(tmp_path: Path, alg: str) -> tuple[Path, dict, bytes]:
    data = np.random.default_rng(1).integers(0, 256, BIG, dtype=np.uint8).tobytes()
    (tmp_path / "big.bin").write_bytes(data)
    manifest = {"files": {"big.bin": {"size": BIG,
                                      "hash": hashing.hash_file(tmp_path / "big.bin", alg)}}}
    return tmp_path, manifest, data


def readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rtrain-read")]


@pytest.mark.parametrize("alg", [hashing.XXH3, hashing.BLAKE3])
def test_a_large_read_on_reader_threads_hashes_every_byte_in_order(tmp_path, alg):
    root, manifest, data = listed(tmp_path, alg)
    buf = bytearray(BIG)
    with ListedFile(root, "big.bin", manifest, alg) as f:
        f.readinto(memoryview(buf)[:7])  # an odd start: later chunks are not aligned
        f.readinto(memoryview(buf)[7:])
        f.finish()
    assert buf == data
    assert not readers()


def test_a_large_file_changed_in_the_middle_is_refused(tmp_path):
    root, manifest, data = listed(tmp_path, hashing.XXH3)
    with open(root / "big.bin", "r+b") as out:
        out.seek(BIG // 2)
        out.write(bytes([data[BIG // 2] ^ 1]))
    with ListedFile(root, "big.bin", manifest, hashing.XXH3) as f:
        f.readinto(memoryview(bytearray(BIG)))
        with pytest.raises(LoadError, match="content hash does not match"):
            f.finish()


def test_a_large_file_cut_short_while_read_fails_and_leaves_no_reader_writing(tmp_path):
    root, manifest, _ = listed(tmp_path, hashing.XXH3)
    with ListedFile(root, "big.bin", manifest, hashing.XXH3) as f:
        os.truncate(root / "big.bin", BIG // 3)  # after the size check at open
        with pytest.raises(LoadError, match="ended early"):
            f.readinto(memoryview(bytearray(BIG)))
    assert not readers(), "a reader thread outlived the failed read"


def test_a_large_file_that_grew_while_read_is_refused(tmp_path):
    root, manifest, _ = listed(tmp_path, hashing.XXH3)
    with ListedFile(root, "big.bin", manifest, hashing.XXH3) as f:
        with open(root / "big.bin", "ab") as out:
            out.write(b"more")
        f.readinto(memoryview(bytearray(BIG)))
        with pytest.raises(LoadError, match="grew"):
            f.finish()


def big_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    side = 3000  # 36 MB of float32 weights: the reader threads' path
    return nn.Sequential(nn.Linear(side, side, bias=False), nn.Linear(side, 3, bias=True))


def test_a_large_checkpoint_swapped_after_verification_leaves_the_model_untouched(tmp_path):
    model = big_model(0)
    path = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    size = (path / "model.safetensors").stat().st_size
    assert size > _PARALLEL_FROM
    with open(path / "model.safetensors", "r+b") as out:  # same size, last chunk differs
        out.seek(size - 5)
        out.write(b"\x7f\x7f\x7f\x7f\x7f")
    other = big_model(1)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    ck = rtrain.Checkpointer(model=other, ckpt_dir=tmp_path,
                             restoring=rtrain.Restoring(verify="quick"))
    with pytest.raises(CorruptCheckpoint, match="content hash does not match"):
        ck.restore(path)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was written before the hash was checked"


def test_tensors_that_start_off_their_element_boundary_load_exactly(tmp_path):
    """safetensors packs tensors without padding: a float64 after 3 bytes of uint8 starts at an
    odd offset of the data, where a view of the buffer cannot start."""
    model = nn.Linear(2, 2)
    extra = {"a": torch.tensor([1, 2, 3], dtype=torch.uint8),
             "b": torch.arange(5, dtype=torch.float64) / 3,
             "c": torch.tensor([True, False]), "d": torch.arange(3, dtype=torch.int32)}
    path = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1, extra=extra)
    header = read_header(path / "extra.safetensors")
    sizes = {"F64": 8, "I32": 4}
    assert any(e["data_offsets"][0] % sizes[e["dtype"]] for e in header.values()
               if isinstance(e, dict) and e.get("dtype") in sizes), "no misaligned tensor"
    ck = rtrain.Checkpointer(model=nn.Linear(2, 2), ckpt_dir=tmp_path)
    assert ck.restore(path) == 1
    for k, v in extra.items():
        assert ck.extra[k].dtype == v.dtype and torch.equal(ck.extra[k], v)
    ck.extra["b"].add_(1)  # memory of its own, writable
    assert torch.equal(ck.extra["b"], extra["b"] + 1)


def _thp_enabled() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


@pytest.mark.skipif(not _thp_enabled(), reason="the kernel offers no transparent huge pages")
def test_restore_fills_its_buffers_without_a_page_fault_per_4_kib(tmp_path):
    """Faulting in fresh memory 4 KiB at a time was most of a restore's cost (262144 faults
    per GiB); the buffer is advised as huge pages, so a restore of 36 MB takes far fewer."""
    model = big_model(0)
    path = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path).save(1)
    target = big_model(1)
    ck = rtrain.Checkpointer(model=target, ckpt_dir=tmp_path,
                             restoring=rtrain.Restoring(verify="quick"))
    ck.restore(path)  # code and allocator warm
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ck.restore(path)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = (path / "model.safetensors").stat().st_size // 4096
    assert faults < pages // 4, f"{faults} page faults to read {pages} pages"
    for k, v in model.state_dict().items():
        assert torch.equal(target.state_dict()[k], v)
