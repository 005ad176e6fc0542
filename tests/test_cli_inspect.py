"""`rtrain inspect`, run as a user runs it: `python -m rtrain` in a subprocess."""

from __future__ import annotations

import json
import os

import pytest
from harness import run_rtrain

from rtrain.checkpoint.layout import MANIFEST, host_name


def flip_last_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.fixture
def run_dir(tmp_path, make_ckpt):
    """A run with checkpoints 100..300 (300 has a flipped byte) and an abandoned temp dir."""
    ckpts = tmp_path / "checkpoints"
    for step in (100, 200, 300):
        make_ckpt(ckpts, step, metrics={"loss": 1000 / step}, settings={"batch_size": 16})
    flip_last_byte(ckpts / "checkpoint-300" / "model.safetensors")
    (ckpts / f".tmp-checkpoint-400-{host_name()}-999999999-abcd1234").mkdir()
    return tmp_path


def test_table_lists_every_checkpoint_and_the_resume_pick(rtrain, run_dir):
    r = rtrain("inspect", str(run_dir / "checkpoints"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "3 checkpoints, verified quick" in lines[0]
    assert lines[1].split() == ["STEP", "EPOCH", "TIME", "SIZE", "METRICS", "SETTINGS", "STATUS"]
    assert lines[2].split()[:3] == ["*", "300", "3"] and lines[2].endswith("ok")
    assert "loss=3.33333" in lines[2] and "batch_size=16" in lines[2]
    assert "resume would pick checkpoint-300" in r.stdout
    assert "abandoned (pid 999999999" in r.stdout and "prune removes it" in r.stdout


def test_full_verification_skips_the_damaged_one_and_exits_1(rtrain, run_dir):
    r = rtrain("inspect", str(run_dir / "checkpoints"), "--verify", "full")
    assert r.returncode == 1
    row_300 = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["300"])
    assert "corrupt: file 'model.safetensors' content hash does not match" in row_300
    assert "resume would pick checkpoint-200" in r.stdout
    assert r.stderr.strip() == ("rtrain: error: 1 of 3 checkpoints failed full verification: "
                                "checkpoint-300")


def test_verification_failure_without_explicit_verify_exits_0(rtrain, run_dir):
    (run_dir / "checkpoints" / "checkpoint-200" / "state.json").unlink()
    r = rtrain("inspect", str(run_dir / "checkpoints"))
    assert r.returncode == 0 and "corrupt: file 'state.json' is missing" in r.stdout


def test_json_listing(rtrain, run_dir):
    r = rtrain("inspect", str(run_dir / "checkpoints"), "--json", "--verify", "full")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["verify"] == "full"
    assert doc["resume"].endswith("checkpoint-200")
    assert [(c["step"], c["status"], c["resume"]) for c in doc["checkpoints"]] == [
        (300, "corrupt", False), (200, "ok", True), (100, "ok", False)]
    assert doc["checkpoints"][1]["metrics"] == {"loss": 5.0}
    assert doc["checkpoints"][1]["settings"] == {"batch_size": 16}
    assert doc["checkpoints"][1]["size"] > 0 and "T" in doc["checkpoints"][1]["time"]
    assert doc["leftovers"][0]["step"] == 400 and doc["leftovers"][0]["writer_alive"] is False


def test_one_checkpoint_in_detail(rtrain, run_dir):
    r = rtrain("inspect", str(run_dir / "checkpoints" / "checkpoint-200"))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ok (verified quick)" in out and "epoch 2" in out and "samples seen 6400" in out
    assert "model.safetensors" in out and "state.json" in out
    assert "fc.weight  F32    [4, 3]" in out and "step       I64    []" in out
    assert "python=3.11" in out and "batch_size=16" in out and "loss=5" in out


def test_one_damaged_checkpoint_names_the_bad_file(rtrain, run_dir):
    r = rtrain("inspect", str(run_dir / "checkpoints" / "checkpoint-300"), "--verify", "full",
               "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["status"] == "corrupt"
    assert {f["name"]: f["status"] for f in doc["files"]} == {
        "model.safetensors": "hash mismatch", "state.json": "ok"}
    assert doc["tensors"]["model.safetensors"]["fc.weight"] == {"dtype": "F32", "shape": [4, 3]}
    assert "checkpoint-300 failed full verification" in r.stderr


def test_tensors_fall_back_to_the_file_header(rtrain, run_dir):
    ckpt = run_dir / "checkpoints" / "checkpoint-100"
    m = json.loads((ckpt / MANIFEST).read_text())
    del m["tensors"]
    (ckpt / MANIFEST).write_text(json.dumps(m))
    doc = json.loads(rtrain("inspect", str(ckpt), "--json").stdout)
    assert doc["tensors"]["model.safetensors"]["fc.bias"] == {"dtype": "F32", "shape": [4]}


def test_no_dir_means_checkpoints_in_the_current_directory(rtrain, run_dir):
    r = rtrain("inspect", cwd=run_dir)
    assert r.returncode == 0 and str(run_dir / "checkpoints") in r.stdout.splitlines()[0]


def test_no_dir_reads_ckpt_dir_from_rtrain_toml(rtrain, run_dir):
    os.rename(run_dir / "checkpoints", run_dir / "elsewhere")
    (run_dir / "rtrain.toml").write_text('ckpt_dir = "elsewhere"\n')
    r = rtrain("inspect", cwd=run_dir)
    assert r.returncode == 0 and "3 checkpoints" in r.stdout


def test_missing_dir_exits_2_with_one_line(rtrain, tmp_path):
    r = rtrain("inspect", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"rtrain: error: no checkpoint directory at {tmp_path / 'nope'}\n"


def test_bad_toml_is_one_line_exit_2(rtrain, tmp_path):
    (tmp_path / "rtrain.toml").write_text("ckpt_dir = \n")
    r = rtrain("inspect", cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("rtrain: error: ") and "Traceback" not in r.stderr


def test_signing_key_from_the_environment_is_honoured(rtrain, tmp_path, make_ckpt):
    make_ckpt(tmp_path, 100)  # unsigned
    r = rtrain("inspect", str(tmp_path), "--verify", "quick",
               env={"RTRAIN_SIGNING_KEY": "secret"})
    assert r.returncode == 1 and "unsigned, but a signing key is configured" in r.stdout
    assert rtrain("inspect", str(tmp_path), "--verify", "quick").returncode == 0


def test_unreadable_key_file_is_a_usage_error(rtrain, tmp_path):
    r = rtrain("inspect", str(tmp_path), env={"RTRAIN_SIGNING_KEY_FILE": str(tmp_path / "k")})
    assert r.returncode == 2 and "RTRAIN_SIGNING_KEY_FILE" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_empty_dir(rtrain, tmp_path):
    r = rtrain("inspect", str(tmp_path))
    assert r.returncode == 0 and "0 checkpoints" in r.stdout


@pytest.mark.slow
def test_inspect_does_not_import_torch(run_dir):
    r = run_rtrain("inspect", str(run_dir / "checkpoints" / "checkpoint-100"),
               env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if "|" in ln}
    assert "rtrain.supervisor.commands.inspecting" in imported  # the trace works
    assert not {m for m in imported if m.split(".")[0] in ("torch", "pydantic", "rich")}


def test_version(rtrain):
    r = rtrain("--version")
    assert r.returncode == 0 and r.stdout.startswith("rtrain ")


def test_bad_option_value_is_a_usage_error(rtrain, tmp_path):
    r = rtrain("inspect", str(tmp_path), "--verify", "sloppy")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "'sloppy'" in r.stderr
