"""`rtrain inspect` over foreign checkpoints: listings, damage, the resume pick; and torch never
imported (checked in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_foreign_verify import flip, hf_checkpoint, member_data_offset, torch_file


def test_trainer_dir_listing_shows_format_damage_and_pick(rtrain, tmp_path):
    hf_checkpoint(tmp_path, 4, loss=0.75)
    d8 = hf_checkpoint(tmp_path, 8)
    flip(d8 / "optimizer.pt", member_data_offset(d8 / "optimizer.pt", "data/0"))
    quick = rtrain("inspect", str(tmp_path))
    assert quick.returncode == 0, quick.stderr
    assert "resume would pick checkpoint-8" in quick.stdout  # quick cannot see a CRC
    full = rtrain("inspect", str(tmp_path), "--verify", "full")
    assert full.returncode == 1
    rows = full.stdout.splitlines()
    assert rows[2].split()[0] == "8" and "corrupt: file 'optimizer.pt'" in rows[2]
    assert "(hf-trainer)" in rows[2]
    assert rows[3].split()[:2] == ["*", "4"] and "loss=0.75" in rows[3]
    assert rows[3].endswith("ok (hf-trainer)")
    one = rtrain("inspect", str(d8), "--verify", "full", "--json")
    detail = json.loads(one.stdout)
    assert detail["format"] == "hf-trainer" and detail["status"] == "corrupt"
    files = {f["name"]: f["status"] for f in detail["files"]}
    assert "CRC-32" in files["optimizer.pt"] and files["model.safetensors"] == "ok"
    assert detail["tensors"]["model.safetensors"]["w"] == {"dtype": "F32", "shape": [8, 4]}


def test_lightning_files_listing_and_one_file(rtrain, tmp_path):
    torch_file(tmp_path / "epoch=0-step=4.ckpt", 4)
    torch_file(tmp_path / "last.ckpt", 4)
    r = rtrain("inspect", str(tmp_path), "--json")
    listing = json.loads(r.stdout)
    assert [(c["name"], c["format"], c["step"]) for c in listing["checkpoints"]] == [
        ("last.ckpt", "lightning", 4), ("epoch=0-step=4.ckpt", "lightning", 4)]  # read inside
    text = rtrain("inspect", str(tmp_path)).stdout
    assert "ok (lightning)  last.ckpt" in text
    one = rtrain("inspect", str(tmp_path / "epoch=0-step=4.ckpt"), "--verify", "full")
    assert one.returncode == 0 and "format      lightning" in one.stdout


@pytest.mark.slow
def test_inspect_of_foreign_checkpoints_never_imports_torch(tmp_path):
    hf_checkpoint(tmp_path / "hf", 4)
    (tmp_path / "pl").mkdir()
    torch_file(tmp_path / "pl" / "epoch=0-step=4.ckpt", 4)
    code = ("import sys\nfrom rtrain.supervisor.cli import main\n"
            "for d in sys.argv[1:]:\n"
            "    sys.argv = ['rtrain', 'inspect', d, '--verify', 'full']\n"
            "    try:\n        main()\n    except SystemExit as e:\n        assert not e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "hf"), str(tmp_path / "pl")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
