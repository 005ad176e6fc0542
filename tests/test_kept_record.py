"""rtrain's record of its kept copy (`<run>/foreign-copy/kept.json`, ckpt/keepcopy.py) is trusted
only when rtrain wrote it: signed with the user's key over the run dir, its source a stepless
checkpoint file. Someone who may write the run dir (a teammate in a group-writable one) plants a
record and a copy naming any entry of the checkpoint dir: the record is ignored with one line,
nothing is overwritten, nothing moved aside. Real files and, for the launch, real processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from harness import events, launch

from rtrain.checkpoint.verify import Level
from rtrain.supervisor.ckpt import foreign, keepcopy


def good(path: Path, it: int) -> Path:
    torch.save({"w": torch.full((64,), float(it)), "iter_num": it}, path)
    return path


def _kept(tmp_path: Path) -> tuple[Path, Path, keepcopy.Kept]:
    run, ck = tmp_path / "run", tmp_path / "ck"
    ck.mkdir()
    kept = keepcopy.keep(run, foreign.verify_path(good(ck / "ckpt.pt", 10), Level.FULL))
    assert kept is not None
    return run, ck, kept


def _record(run: Path) -> dict:
    return json.loads((run / keepcopy.KEPT_DIR / keepcopy.RECORD).read_text())


def _write(run: Path, record: dict) -> None:
    (run / keepcopy.KEPT_DIR / keepcopy.RECORD).write_text(json.dumps(record))


def test_rtrains_own_record_is_signed_and_read_back(tmp_path):
    run, _, kept = _kept(tmp_path)
    assert isinstance(_record(run)["mac"], str)
    assert keepcopy.read(run) == (kept, None)


@pytest.mark.parametrize("change, why", [
    ({"mac": None}, "not signed by an rtrain of this user"),
    ({"mac": "0" * 64}, "not signed by an rtrain of this user"),
    ({"step": 11}, "not signed by an rtrain of this user"),  # any field changed
    ({"source": "/elsewhere/ckpt.pt"}, "not signed by an rtrain of this user"),
])
def test_a_record_rtrain_did_not_write_is_ignored_with_the_reason(tmp_path, change, why):
    run, _, _ = _kept(tmp_path)
    _write(run, {**_record(run), **change})
    kept, ignored = keepcopy.read(run)
    assert kept is None and why in ignored


def test_a_record_copied_from_another_run_dir_is_ignored(tmp_path):
    run, _, _ = _kept(tmp_path)
    other = tmp_path / "other"
    (other / keepcopy.KEPT_DIR).mkdir(parents=True)
    _write(other, _record(run))
    assert keepcopy.read(other)[0] is None


@pytest.mark.parametrize("source, ok", [
    ("/ck/ckpt.pt", True), ("/ck/last.ckpt", True), ("/ck/notes.yaml", False),
    ("/ck/checkpoint-100", False), ("/ck/step_10.pt", False), ("/ck/../etc/ckpt.pt", False),
    ("ck/ckpt.pt", False), ("/ck/.hidden.pt", False), ("/ck//ckpt.pt", False),
])
def test_only_a_stepless_checkpoint_file_can_be_a_source(source, ok):
    assert (keepcopy.source_problem(source) is None) == ok


def test_a_copy_that_is_not_the_recorded_content_is_not_restored(tmp_path):
    run, ck, kept = _kept(tmp_path)
    good(kept.copy_path(run), 99)  # replaced, and it verifies: still not what was recorded
    (ck / "ckpt.pt").write_bytes(b"torn")
    with pytest.raises(keepcopy.NotRestored):
        keepcopy.restore(run, kept)
    assert (ck / "ckpt.pt").read_bytes() == b"torn"


def test_a_link_at_the_live_path_is_not_written_over(tmp_path):
    run, ck, kept = _kept(tmp_path)
    (ck / "ckpt.pt").unlink()
    (ck / "ckpt.pt").symlink_to(tmp_path / "elsewhere.pt")
    with pytest.raises(keepcopy.NotRestored):
        keepcopy.restore(run, kept)
    assert (ck / "ckpt.pt").is_symlink()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["notes.yaml", "checkpoint-100", "ckpt.pt"])
def test_a_planted_record_overwrites_and_renames_nothing(tmp_path, make_ckpt, target):
    """The issue's case: a planted kept.json whose source names the user's notes.yaml, the
    newest good checkpoint, or a torn ckpt.pt, with a planted copy that verifies. The launch
    says it ignored the record and resumes from the newest good checkpoint; every entry of
    the checkpoint dir is as it was."""
    run, ck = tmp_path / "run", tmp_path / "run" / "checkpoints"
    make_ckpt(ck, 50)
    make_ckpt(ck, 100)
    (ck / "notes.yaml").write_text("lr: 3e-4  # my notes\n")
    (ck / "ckpt.pt").write_bytes(b"torn")  # no verdict either way: a file the pick skips
    planted = run / keepcopy.KEPT_DIR
    planted.mkdir(parents=True)
    good(planted / target, 7)
    source = ck.resolve() / target
    (planted / keepcopy.RECORD).write_text(json.dumps({
        "version": keepcopy.VERSION, "source": str(source), "fingerprint": "x", "step": 7,
        "verified_at": 0.0, "bytes": 1, "how": "copy"}))
    before = {p.name: (p.read_bytes() if p.is_file() else sorted(x.name for x in p.iterdir()))
              for p in ck.iterdir()}
    script = tmp_path / "train.py"
    script.write_text("import sys; print('resumed from', sys.argv[1])\n")
    r = launch(run, str(script), "{checkpoint}", timeout=120)
    assert r.returncode == 0, r.stderr
    after = {p.name: (p.read_bytes() if p.is_file() else sorted(x.name for x in p.iterdir()))
             for p in ck.iterdir() if not p.name.startswith(".rtrain")}
    assert after == before  # nothing overwritten, nothing renamed .refused-*
    assert "ignored" in r.stderr and "kept.json" in r.stderr
    assert not events(run, "foreign_restored")
    [first] = events(run, "launch")
    assert first["resume_from"].endswith("checkpoint-100")
