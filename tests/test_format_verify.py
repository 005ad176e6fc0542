"""Corruption matrix: each damage is detected with its reason, and resume falls back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rtrain.checkpoint import hashing
from rtrain.checkpoint.layout import MANIFEST
from rtrain.checkpoint.verify import Level, Status, select_rtrain_resume, verify


@pytest.fixture
def two(tmp_path, make_ckpt) -> tuple[Path, Path]:
    """checkpoint-100 (good, the fallback) and checkpoint-200 (the one each test damages)."""
    return make_ckpt(tmp_path, 100), make_ckpt(tmp_path, 200)


def rewrite_manifest(ckpt: Path, **changes) -> None:
    m = json.loads((ckpt / MANIFEST).read_text())
    m.update(changes)
    (ckpt / MANIFEST).write_text(json.dumps(m))


def assert_falls_back(ckpt_dir: Path, level: Level, key: bytes | None = None) -> str:
    sel = select_rtrain_resume(ckpt_dir, level, key)
    assert sel.chosen is not None and sel.chosen.step == 100
    assert [v.step for v in sel.skipped] == [200]
    return sel.skipped[0].reason


def test_good_checkpoints_verify_at_both_levels(two):
    for level in Level:
        assert verify(two[1], level).ok
    assert select_rtrain_resume(two[0].parent).chosen.step == 200


def test_truncated_file(two):
    target = two[1] / "model.safetensors"
    os.truncate(target, target.stat().st_size - 3)
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.CORRUPT
    assert "'model.safetensors'" in v.reason and "truncated" in v.reason
    assert "truncated" in assert_falls_back(two[1].parent, Level.QUICK)


def test_flipped_byte_caught_by_full_not_quick(two):
    target = two[1] / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0x01
    target.write_bytes(bytes(data))
    assert verify(two[1], Level.QUICK).ok  # sizes alone cannot see it
    v = verify(two[1], Level.FULL)
    assert v.status is Status.CORRUPT and "content hash does not match" in v.reason
    assert "content hash" in assert_falls_back(two[1].parent, Level.FULL)


def test_missing_file(two):
    (two[1] / "state.json").unlink()
    assert verify(two[1], Level.QUICK).reason == "file 'state.json' is missing"
    assert "missing" in assert_falls_back(two[1].parent, Level.QUICK)


def test_missing_manifest_is_incomplete(two):
    (two[1] / MANIFEST).unlink()
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.INCOMPLETE and "no manifest.json" in v.reason
    assert_falls_back(two[1].parent, Level.QUICK)


def test_unparsable_manifest(two):
    (two[1] / MANIFEST).write_text('{"format": "rtrain-checkpoint", ')
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.CORRUPT and "not valid JSON" in v.reason
    assert_falls_back(two[1].parent, Level.QUICK)


def test_unknown_format_version(two):
    rewrite_manifest(two[1], version=99)
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.CORRUPT and "unknown format version 99" in v.reason
    assert "upgrade rtrain" in assert_falls_back(two[1].parent, Level.QUICK)


def test_manifest_step_differs_from_directory_name(two):
    rewrite_manifest(two[1], step=300)
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.CORRUPT
    assert v.reason == "manifest says step 300 but the directory is checkpoint-200"
    assert_falls_back(two[1].parent, Level.QUICK)


@pytest.mark.parametrize("name, words", [
    ("../x", "leaves the checkpoint directory"),
    ("sub/../../x", "leaves the checkpoint directory"),
    ("/etc/passwd", "absolute path"),
])
def test_traversal_in_manifest_file_name(two, name, words):
    m = json.loads((two[1] / MANIFEST).read_text())
    m["files"][name] = {"size": 1, "hash": "0" * 32}
    (two[1] / MANIFEST).write_text(json.dumps(m))
    v = verify(two[1], Level.QUICK)
    assert v.status is Status.CORRUPT and words in v.reason
    assert_falls_back(two[1].parent, Level.QUICK)


def test_symlink_leading_outside_is_refused(two, tmp_path):
    outside = tmp_path.parent / f"{tmp_path.name}-outside.bin"
    target = two[1] / "state.json"
    outside.write_bytes(target.read_bytes())  # same size and hash: only the link is wrong
    target.unlink()
    target.symlink_to(outside)
    try:
        v = verify(two[1], Level.FULL)
        assert v.status is Status.CORRUPT
        assert "link leading outside the checkpoint" in v.reason
        assert_falls_back(two[1].parent, Level.FULL)
    finally:
        outside.unlink()


def test_symlink_inside_the_checkpoint_is_allowed(two):
    target = two[1] / "state.json"
    (two[1] / "real.json").write_bytes(target.read_bytes())
    target.unlink()
    target.symlink_to("real.json")
    assert verify(two[1], Level.FULL).ok


KEY = hashing.derive_key(b"test secret")


@pytest.fixture
def signed(tmp_path, make_ckpt) -> tuple[Path, Path]:
    return make_ckpt(tmp_path, 100, key=KEY), make_ckpt(tmp_path, 200, key=KEY)


def test_signed_checkpoint_verifies_with_its_key(signed):
    assert verify(signed[1], Level.FULL, KEY).ok


def test_tampered_signed_manifest_is_refused(signed):
    rewrite_manifest(signed[1], metrics={"loss": 0.0})  # signature left as it was
    v = verify(signed[1], Level.QUICK, KEY)
    assert v.status is Status.CORRUPT and "signature does not match" in v.reason
    assert_falls_back(signed[1].parent, Level.QUICK, KEY)


def test_other_key_is_refused(signed):
    v = verify(signed[1], Level.QUICK, hashing.derive_key(b"another secret"))
    assert "signature does not match" in v.reason


def test_unsigned_checkpoint_refused_when_a_key_is_configured(tmp_path, make_ckpt):
    make_ckpt(tmp_path, 100, key=KEY)
    unsigned = make_ckpt(tmp_path, 200)
    v = verify(unsigned, Level.QUICK, KEY)
    assert v.status is Status.CORRUPT and v.reason.startswith("unsigned")
    assert_falls_back(tmp_path, Level.QUICK, KEY)


def test_signed_checkpoint_verifies_without_a_key(signed):
    assert verify(signed[1], Level.FULL, None).ok


def test_signing_key_from_env_and_file(tmp_path):
    assert hashing.load_signing_key({}) is None
    assert hashing.load_signing_key({"RTRAIN_SIGNING_KEY": "test secret"}) == KEY
    key_file = tmp_path / "key"
    key_file.write_bytes(b"test secret\n")
    key_file.chmod(0o600)  # a key others can read is refused (tests/test_secrets.py)
    assert hashing.load_signing_key({"RTRAIN_SIGNING_KEY_FILE": str(key_file)}) == KEY
