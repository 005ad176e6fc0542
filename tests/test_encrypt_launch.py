"""Encrypted checkpoints end to end, real processes: a run under `rtrain launch` with a key
crashes, resumes from its encrypted checkpoint and ends bitwise-identical to a run never
interrupted; the checkpoints inspect and verify without the key; a tampered one is refused by
the worker (tag) and the run goes on from the one before."""

from __future__ import annotations

import json

import pytest
import torch
from bitwise import assert_bitwise_equal
from harness import CHILDREN, events, launch, launch_2_ranks, run_rtrain
from references import bitwise_run

from rtrain.checkpoint import crypt, encrypted_file
from rtrain.checkpoint.hashing import hash_file
from rtrain.checkpoint.layout import list_checkpoints

SCRIPT = CHILDREN / "train_bitwise.py"
KEY = "3c" * 32


@pytest.fixture(scope="module")
def uninterrupted():
    # Unencrypted: the key changes the files, never a value a step trains on.
    return torch.load(bitwise_run(31))


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "sync",
    # The forked writer's files sealed is test_worker_encrypt.py's (a real fork), and a crash
    # and resume under rtrain with async saves, bitwise, is test_worker_resume.py's: soak here.
    pytest.param("async", marks=pytest.mark.soak),
])
def test_crash_and_resume_from_encrypted_checkpoints_is_bitwise(tmp_path, mode, uninterrupted):
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    extra = ["--async"] if mode == "async" else []  # async on CPU: the forked writer
    r = launch(run, str(SCRIPT), str(ckpts), str(out), "31", "0", *extra,
               env={"RTRAIN_ENCRYPTION_KEY": KEY, "RTRAIN_FAULTS": "crash@step=11"},
               timeout=180)
    assert r.returncode == 0, r.stderr
    starts = events(run, "launch")
    assert len(starts) == 2 and starts[1]["resume_from"].endswith("checkpoint-9")
    b = torch.load(out)
    assert b["step"] == 31
    assert_bitwise_equal(uninterrupted["model"], b["model"], "model")
    assert_bitwise_equal(uninterrupted["opt"], b["opt"], "optimizer")
    fp = crypt.EncryptionKey.from_material(KEY).fingerprint
    for _, path in list_checkpoints(ckpts):
        m = json.loads((path / "manifest.json").read_text())
        assert m["encryption"]["key_fingerprint"] == fp
        assert all((path / n).read_bytes().startswith(encrypted_file.MAGIC) for n in m["files"])
    # Without the key: the manifest reads, every file verifies.
    r = run_rtrain("inspect", str(ckpts), "--verify", "full")
    assert r.returncode == 0 and "checkpoint-30" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
@pytest.mark.soak  # a tampered or keyless file is refused in test_crypt.py's unit tests
def test_tampered_and_keyless_resumes(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out.pt"
    ckpts = run / "checkpoints"
    env = {"RTRAIN_ENCRYPTION_KEY": KEY}
    r = launch(run, str(SCRIPT), str(ckpts), str(out), "12", "0", env=env, timeout=180)
    assert r.returncode == 0, r.stderr
    # Flip a ciphertext byte of the newest and fix its hash in the manifest, as a writer of
    # the dir could: verification passes, the worker's tag check refuses it (bad checkpoint)
    # and the next attempt resumes from the one before.
    newest = list_checkpoints(ckpts)[0][1]
    assert newest.name == "checkpoint-12"
    f = newest / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[encrypted_file.HEADER_SIZE + 5] ^= 1
    f.write_bytes(bytes(data))
    m = json.loads((newest / "manifest.json").read_text())
    m["files"]["model.safetensors"]["hash"] = hash_file(f, m["hash_alg"])
    (newest / "manifest.json").write_text(json.dumps(m))
    r = launch(run, "--fresh", str(SCRIPT), str(ckpts), str(out), "13", "0", env=env,
               timeout=180)
    assert r.returncode == 0, r.stderr
    skipped = events(run, "skipped_checkpoint")
    assert skipped and "fails authentication" in skipped[0]["reason"]
    assert events(run, "launch")[-1]["resume_from"].endswith("checkpoint-9")
    assert "checkpoint-12" in skipped[0]["path"]
    # No key, or another: refused before any attempt, naming the fingerprints.
    for bad in ({}, {"RTRAIN_ENCRYPTION_KEY": "passphrase, not the key"}):
        r = launch(run, "--fresh", str(SCRIPT), str(ckpts), str(out), "14", "0", env=bad)
        assert r.returncode == 2
        assert crypt.EncryptionKey.from_material(KEY).fingerprint in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.soak  # encrypted one-process resumes are the default tier's
def test_fsdp_two_ranks_resume_bitwise_from_encrypted_shards(tmp_path):
    from test_dist_resume import _fsdp_available

    why = _fsdp_available()
    if why:
        pytest.skip(why)
    env = {"RTRAIN_ENCRYPTION_KEY": KEY}
    ref = launch_2_ranks(tmp_path / "ref", str(tmp_path / "ref"), "10", "--fsdp")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "split"
    r = launch_2_ranks(run, str(tmp_path / "split"), "10", "--die-at", "7", "--die-rank", "1",
                       "--fsdp", extra_env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert events(run, "launch")[1]["resume_from"].endswith("checkpoint-6")
    for rank in (0, 1):
        a = torch.load(tmp_path / f"ref-rank{rank}.pt", weights_only=False)
        b = torch.load(tmp_path / f"split-rank{rank}.pt", weights_only=False)
        assert_bitwise_equal(a, b, f"rank{rank}")
    ckpt = run / "checkpoints" / "checkpoint-9"
    m = json.loads((ckpt / "manifest.json").read_text())
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp",
            "rng-rank1.safetensors"} <= m["files"].keys()
    assert all((ckpt / n).read_bytes().startswith(encrypted_file.MAGIC) for n in m["files"])
