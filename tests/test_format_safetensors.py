"""Files from safetensors_io are plain safetensors: the real library reads them bit-exactly."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from conftest import blob
from safetensors.numpy import load_file

from rtrain.checkpoint import hashing, safetensors_io
from rtrain.checkpoint.safetensors_io import TensorBlob


def test_round_trip_through_the_safetensors_library(tmp_path):
    arrays = {
        "weight": np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32),
        "scalar": np.array(3.5, np.float64),  # 0-d
        "empty": np.zeros((0, 4), np.float32),
        "ids": np.arange(11, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "half": np.linspace(-1, 1, 6, dtype=np.float16).reshape(2, 3),
    }
    path = tmp_path / "t.safetensors"
    written = safetensors_io.write_file(path, [blob(k, v) for k, v in arrays.items()],
                                        fsync=False)
    assert written.size == path.stat().st_size
    assert written.hash == hashing.hash_file(path)
    loaded = load_file(str(path))
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape
        assert loaded[name].tobytes() == array.tobytes()
    header = safetensors_io.read_header(path)
    assert header["scalar"]["shape"] == [] and header["empty"]["shape"] == [0, 4]


def test_bf16_as_raw_bytes(tmp_path):
    # bfloat16 has no numpy dtype: the worker hands its bytes over as they are.
    values = np.array([1.0, -2.5, 2.0**100], np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation, exact for these
    path = tmp_path / "bf16.safetensors"
    safetensors_io.write_file(path, [TensorBlob("x", "BF16", (3,), memoryview(bf16.tobytes()))],
                              fsync=False)
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() is None and list(f.keys()) == ["x"]
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8:8 + n])["x"] == {"dtype": "BF16", "shape": [3],
                                               "data_offsets": [0, 6]}
    assert raw[8 + n:] == bf16.tobytes()
    assert (np.frombuffer(raw[8 + n:], np.uint16).astype(np.uint32) << 16).view(np.float32) \
        .tolist() == values.tolist()


def write_raw(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("header, data, words", [
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "header describes"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8, "does not fill"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
    ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
    ({"a": [1, 2]}, b"", "not an object"),
])
def test_read_header_rejects_a_lying_header(tmp_path, header, data, words):
    path = tmp_path / "lie.safetensors"
    write_raw(path, header, data)
    with pytest.raises(ValueError, match=words):
        safetensors_io.read_header(path)


def test_read_header_rejects_a_header_longer_than_the_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match="does not fit in a file"):
        safetensors_io.read_header(path)
