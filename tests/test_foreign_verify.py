"""Foreign checkpoints (Hugging Face Trainer dirs, Lightning .ckpt, torch.save files) checked
without unpickling: the damage matrix per format, each with its reason, and resume falling back
to the previous checkpoint. Files are made by torch.save / safetensors here, in milliseconds."""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rtrain.checkpoint.verify import Status
from rtrain.supervisor.ckpt import foreign, torchzip


def torch_file(path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    torch.save({"w": torch.randn(64, 64, generator=g), "step": seed}, path)
    return path


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def member_data_offset(path: Path, suffix: str) -> int:
    """Where a member's bytes start (e.g. the tensor storage `data/0`)."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def hf_checkpoint(out: Path, step: int, *, loss: float = 1.0) -> Path:
    d = out / f"checkpoint-{step}"
    d.mkdir(parents=True)
    save_file({"w": torch.full((8, 4), float(step))}, str(d / "model.safetensors"))
    torch_file(d / "optimizer.pt", step)
    torch.save({"last_epoch": step}, d / "scheduler.pt")
    torch.save({"python": step}, d / "rng_state.pth")
    torch.save({"lr": 1e-3}, d / "training_args.bin")
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    state = {"global_step": step, "epoch": step / 8, "train_batch_size": 4,
             "log_history": [{"loss": loss, "step": step}]}
    (d / "trainer_state.json").write_text(json.dumps(state))
    return d


# ----------------------------------------------------------------- torch.save zip files

def test_sound_torch_file_passes_quick_and_full(tmp_path):
    p = torch_file(tmp_path / "a.pt")
    assert torchzip.check(p, full=False) == "" and torchzip.check(p, full=True) == ""


def test_flipped_byte_is_a_crc_mismatch_at_full_only(tmp_path):
    p = torch_file(tmp_path / "a.pt")
    flip(p, member_data_offset(p, "data/0") + 100)
    assert torchzip.check(p, full=False) == ""  # structure intact: quick cannot see it
    with pytest.raises(torchzip.TorchFileError, match=r"data/0'.*CRC-32 .* does not match"):
        torchzip.check(p, full=True)


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_truncated_file_is_refused(tmp_path, keep):
    p = torch_file(tmp_path / "a.pt")
    data = p.read_bytes()
    p.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(torchzip.TorchFileError, match="truncated"):
        torchzip.check(p, full=False)


def test_member_cut_short_inside_the_archive(tmp_path):
    """Bytes missing from the middle of a member: the central directory no longer fits."""
    p = torch_file(tmp_path / "a.pt")
    start = member_data_offset(p, "data/0")
    data = p.read_bytes()
    p.write_bytes(data[:start + 64] + data[start + 64 + 256:])
    with pytest.raises(torchzip.TorchFileError) as err:
        torchzip.check(p, full=True)
    assert "member" in str(err.value) or "zip structure" in str(err.value)


def test_not_torch_and_empty_and_legacy(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"hello world")
    with pytest.raises(torchzip.TorchFileError, match="neither a zip archive"):
        torchzip.check(tmp_path / "junk.pt", full=True)
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(torchzip.TorchFileError, match="empty file"):
        torchzip.check(tmp_path / "empty.pt", full=True)
    with zipfile.ZipFile(tmp_path / "other.pt", "w") as zf:
        zf.writestr("a/readme.txt", "no pickle here")
    with pytest.raises(torchzip.TorchFileError, match=r"without data\.pkl"):
        torchzip.check(tmp_path / "other.pt", full=True)
    torch.save({"x": torch.ones(2)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert "legacy" in torchzip.check(tmp_path / "old.pt", full=True)


# ----------------------------------------------------------------- Hugging Face Trainer dirs

def test_sound_trainer_dir_verifies_with_its_state(tmp_path):
    d = hf_checkpoint(tmp_path, 8, loss=0.5)
    v = foreign.verify_path(d, "full")
    assert v.ok and v.format == "hf-trainer" and v.step == 8
    assert v.info["metrics"] == {"loss": 0.5} and v.info["epoch"] == 1.0


def _bad_json(d: Path) -> None:
    (d / "trainer_state.json").write_text('{"global_step": 8, "epoch"')


def _lying_header(d: Path) -> None:
    p = d / "model.safetensors"
    data = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["w"]["shape"] = [16, 4]  # says twice the bytes the file has
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data[8 + n:]))


def _cut_safetensors(d: Path) -> None:
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-16])


def _flip_optimizer(d: Path) -> None:
    flip(d / "optimizer.pt", member_data_offset(d / "optimizer.pt", "data/0") + 8)


CASES = {
    "bad trainer_state JSON": (_bad_json, Status.CORRUPT, "trainer_state.json': not valid JSON"),
    "no trainer_state (save cut)": (lambda d: (d / "trainer_state.json").unlink(),
                                    Status.INCOMPLETE, "no trainer_state.json"),
    "no weights": (lambda d: (d / "model.safetensors").unlink(), Status.CORRUPT,
                   "no model weights"),
    "scheduler without optimizer": (lambda d: (d / "optimizer.pt").unlink(), Status.CORRUPT,
                                    "'optimizer.pt' is missing"),
    "lying safetensors header": (_lying_header, Status.CORRUPT, "does not fill data_offsets"),
    "truncated safetensors": (_cut_safetensors, Status.CORRUPT, "the file has"),
    "flipped byte in optimizer.pt": (_flip_optimizer, Status.CORRUPT,
                                     "'optimizer.pt': member .* CRC-32"),
    "truncated rng state": (lambda d: (d / "rng_state.pth").write_bytes(
        (d / "rng_state.pth").read_bytes()[:100]), Status.CORRUPT, "rng_state.pth'.*truncated"),
    "bad config.json": (lambda d: (d / "config.json").write_text("{"), Status.CORRUPT,
                        "config.json': not valid JSON"),
    "global_step disagrees": (lambda d: (d / "trainer_state.json").write_text(
        json.dumps({"global_step": 7})), Status.CORRUPT, "global_step 7 but the directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_trainer_dir_is_skipped_for_the_previous_one(tmp_path, case):
    damage, status, reason = CASES[case]
    hf_checkpoint(tmp_path, 4)
    damage(hf_checkpoint(tmp_path, 8))
    sel = foreign.select_resume_any_format(tmp_path, "full")
    assert sel.chosen is not None and sel.chosen.path.name == "checkpoint-4"
    (bad,) = sel.skipped
    assert bad.path.name == "checkpoint-8" and bad.status is status
    assert bad.format == "hf-trainer"
    assert re.search(reason, bad.reason), bad.reason


def test_sharded_weights_index_and_its_shards(tmp_path):
    d = hf_checkpoint(tmp_path, 4)
    (d / "model.safetensors").unlink()
    save_file({"a": torch.zeros(2)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(3)}, str(d / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert foreign.verify_path(d, "quick").ok
    (d / "model-00002-of-00002.safetensors").unlink()
    v = foreign.verify_path(d, "quick")
    assert not v.ok and "'model-00002-of-00002.safetensors' is missing" in v.reason
    index["weight_map"]["c"] = "model-00001-of-00002.safetensors"
    save_file({"b": torch.zeros(3)}, str(d / "model-00002-of-00002.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    v = foreign.verify_path(d, "quick")
    assert "lacks tensors the index puts there: c" in v.reason


def test_model_only_save_passes_with_a_note(tmp_path):
    d = hf_checkpoint(tmp_path, 4)
    (d / "optimizer.pt").unlink()
    (d / "scheduler.pt").unlink()
    v = foreign.verify_path(d, "full")
    assert v.ok and "optimizer state starts fresh" in v.info["note"]


def test_deepspeed_layout_is_not_rejected_for_its_weights(tmp_path):
    d = hf_checkpoint(tmp_path, 4)
    (d / "model.safetensors").unlink()
    (d / "optimizer.pt").unlink()  # inside global_step4/; scheduler.pt stays beside it
    (d / "global_step4").mkdir()
    v = foreign.verify_path(d, "full")
    assert v.ok and v.info["note"] == "weights in global_step4/: not checked"


def test_rtrain_and_trainer_dirs_side_by_side(tmp_path, make_ckpt):
    make_ckpt(tmp_path, 4)
    hf_checkpoint(tmp_path, 8)
    (tmp_path / "checkpoint-12").mkdir()  # an rtrain save that never got its manifest
    vs = foreign.verify_all(tmp_path, "full")
    assert [(v.path.name, v.format, v.status.value) for v in vs] == [
        ("checkpoint-12", "rtrain", "incomplete"), ("checkpoint-8", "hf-trainer", "ok"),
        ("checkpoint-4", "rtrain", "ok")]
    assert foreign.select_resume_any_format(tmp_path, "full").chosen.path.name == "checkpoint-8"


# ----------------------------------------------------------------- Lightning / plain files

def test_lightning_files_ordered_by_step_then_last_ckpt(tmp_path):
    for i, step in enumerate((4, 8, 12)):
        torch_file(tmp_path / f"epoch={i}-step={step}.ckpt", step)
        os.utime(tmp_path / f"epoch={i}-step={step}.ckpt", (1000 + i, 1000 + i))
    torch_file(tmp_path / "last.ckpt", 12)
    os.utime(tmp_path / "last.ckpt", (1002, 1002))  # written with step 12
    names = [c.path.name for c in foreign.list_candidates(tmp_path)]
    assert names == ["last.ckpt", "epoch=2-step=12.ckpt", "epoch=1-step=8.ckpt",
                     "epoch=0-step=4.ckpt"]
    for name in ("last.ckpt", "epoch=2-step=12.ckpt"):
        p = tmp_path / name
        stamp = p.stat().st_mtime
        flip(p, member_data_offset(p, "data/0"))
        os.utime(p, (stamp, stamp))
    sel = foreign.select_resume_any_format(tmp_path, "full")
    assert sel.chosen.path.name == "epoch=1-step=8.ckpt" and sel.chosen.step == 8
    assert sel.chosen.format == "lightning"
    assert [v.path.name for v in sel.skipped] == ["last.ckpt", "epoch=2-step=12.ckpt"]
    assert all("CRC-32" in v.reason for v in sel.skipped)


def test_plain_files_without_steps_go_by_mtime(tmp_path):
    torch_file(tmp_path / "plain.pt")
    torch_file(tmp_path / "older.pth")
    os.utime(tmp_path / "older.pth", (1000, 1000))
    (tmp_path / "plain.pt.tmp-123").write_bytes(b"half")  # the example's temp file: ignored
    (tmp_path / "training_args.bin").write_bytes(b"x")  # never a checkpoint
    names = [c.path.name for c in foreign.list_candidates(tmp_path)]
    assert names == ["plain.pt", "older.pth"]
    chosen = foreign.select_resume_any_format(tmp_path, "quick").chosen
    # The step comes from the pickle's "step" key (0 here): it is shown, never the order here.
    assert chosen.path.name == "plain.pt" and chosen.step == 0 and chosen.format == "torch"
    assert chosen.info["step_from"] == "step in the pickle"


def test_loose_files_do_not_count_beside_checkpoint_dirs(tmp_path):
    hf_checkpoint(tmp_path, 4)
    torch_file(tmp_path / "pytorch_model.bin")  # a Trainer's final model, not a resume point
    assert [c.path.name for c in foreign.list_candidates(tmp_path)] == ["checkpoint-4"]


@pytest.mark.parametrize("name,step", [("epoch=3-step=400.ckpt", 400), ("step_12.pt", 12),
                                       ("checkpoint-30.pth", 30), ("ckpt500.pt", 500),
                                       ("model_iter_7.bin", 7), ("epoch=3.ckpt", None),
                                       ("plain.pt", None)])
def test_step_from_name(name, step):
    assert foreign.step_from_name(name) == step
