"""atomic_write.write_atomic: the old file or the new one, never half, and no temp file left
behind."""

from __future__ import annotations

import os

import pytest

from rtrain.supervisor.core.atomic_write import write_atomic, write_json_atomic


def test_replaces_with_the_given_mode(tmp_path):
    target = tmp_path / "sub" / "state.json"
    write_json_atomic(target, {"v": 1})
    write_atomic(target, "new\n", mode=0o644, durable=False)
    assert target.read_text() == "new\n"
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert os.listdir(target.parent) == ["state.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "metrics.prom"
    target.write_text("old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["metrics.prom"]
