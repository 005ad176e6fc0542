"""Encrypted checkpoints seen by the supervisor's commands: `rtrain inspect` reads and verifies
them without the key; `rtrain launch` refuses, before any attempt, to resume one whose key it
was not given."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import blob
from harness import events

from rtrain.checkpoint import crypt
from rtrain.checkpoint.commit import PendingCheckpoint

KEY = crypt.EncryptionKey(bytes(range(32)))
KEY_HEX = bytes(range(32)).hex()
OTHER_HEX = "ff" * 32


def _encrypted(ckpt_dir: Path, step: int, key: crypt.EncryptionKey = KEY) -> Path:
    pending = PendingCheckpoint(ckpt_dir, step, fsync=False, encryption=key)
    pending.write_tensors("model.safetensors",
                          [blob("w", np.arange(6, dtype=np.float32).reshape(2, 3))])
    pending.write_json("state.json", {"step": step})
    return pending.commit({"epoch": 0, "samples_seen": 0, "fingerprint": "f" * 32,
                           "metrics": {"loss": 0.5}, "info": {}})


def test_inspect_reads_and_fully_verifies_without_the_key(tmp_path, rtrain):
    path = _encrypted(tmp_path, 7)
    r = rtrain("inspect", str(path), "--verify", "full")
    assert r.returncode == 0, r.stderr
    assert f"key fingerprint {KEY.fingerprint}" in r.stdout
    assert "w" in r.stdout and "F32" in r.stdout  # names and shapes: readable by default
    j = json.loads(rtrain("inspect", str(path), "--json").stdout)
    assert j["encryption"]["key_fingerprint"] == KEY.fingerprint and j["status"] == "ok"
    r = rtrain("inspect", str(tmp_path), "--verify", "full")
    assert r.returncode == 0 and "checkpoint-7" in r.stdout


def test_inspect_says_when_tensor_names_were_left_out(tmp_path, rtrain):
    path = _encrypted(tmp_path, 7, crypt.EncryptionKey(KEY.key, hide_tensors=True))
    r = rtrain("inspect", str(path), "--verify", "full")
    assert r.returncode == 0, r.stderr
    assert "names and shapes not recorded" in r.stdout


def test_inspect_full_catches_a_changed_ciphertext_byte(tmp_path, rtrain):
    path = _encrypted(tmp_path, 7)
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    r = rtrain("inspect", str(path), "--verify", "full")
    assert r.returncode == 1 and "content hash does not match" in r.stdout


def _launch(rtrain, tmp_path: Path, env: dict[str, str]):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    return rtrain("launch", "--run-dir", str(tmp_path / "run"), "-q", "--no-backoff",
                  str(script), cwd=tmp_path, env=env)


@pytest.mark.parametrize("env", [{}, {"RTRAIN_ENCRYPTION_KEY": OTHER_HEX}])
def test_launch_refuses_a_checkpoint_its_key_cannot_open(tmp_path, rtrain, env):
    _encrypted(tmp_path / "run" / "checkpoints", 7)
    r = _launch(rtrain, tmp_path, env)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert err.startswith("rtrain: error: cannot resume from checkpoint-7: ") and "\n" not in err
    assert KEY.fingerprint in err
    if env:
        assert crypt.EncryptionKey.from_material(OTHER_HEX).fingerprint in err
    assert not events(tmp_path / "run", "launch")


def test_launch_with_a_bad_key_file_is_one_line(tmp_path, rtrain):
    key = tmp_path / "key"
    key.write_text(KEY_HEX)
    key.chmod(0o644)
    r = _launch(rtrain, tmp_path, {"RTRAIN_ENCRYPTION_KEY_FILE": str(key)})
    assert r.returncode == 2 and "chmod 600" in r.stderr


def test_launch_without_the_cryptography_package_is_one_line(tmp_path, rtrain, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cryptography" else real(name, *a))
    r = _launch(rtrain, tmp_path, {"RTRAIN_ENCRYPTION_KEY": KEY_HEX})
    assert r.returncode == 2 and "pip install 'rtrain[encrypt]'" in r.stderr


@pytest.mark.slow
def test_inspect_and_the_launch_check_never_import_the_cipher_or_torch(tmp_path):
    import os
    import subprocess
    import sys


    _encrypted(tmp_path / "run" / "checkpoints", 7)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('never started')\n")
    code = ("import sys\nfrom rtrain.supervisor.cli import main\n"
            "for argv in (['inspect', sys.argv[1], '--verify', 'full'],\n"
            "             ['launch', '--run-dir', sys.argv[2], '-q', sys.argv[3]]):\n"
            "    sys.argv = ['rtrain', *argv]\n"
            "    try:\n        main()\n    except SystemExit as e:\n        print('code', e.code)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'cryptography' not in sys.modules, 'cryptography imported'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    env.update(RTRAIN_ENCRYPTION_KEY=OTHER_HEX)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run" / "checkpoints"),
                        str(tmp_path / "run"), str(script)], capture_output=True, text=True,
                       env=env, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    codes = [line for line in r.stdout.splitlines() if line.startswith("code ")]
    assert codes == ["code 0", "code 2"], r.stdout  # inspect ok; launch refused (other key)


# ---------------------------------------------------------------- a checkpoint of another key


def _plain(ckpt_dir: Path, step: int) -> Path:
    pending = PendingCheckpoint(ckpt_dir, step, fsync=False)
    pending.write_tensors("model.safetensors", [blob("w", np.zeros(6, dtype=np.float32))])
    pending.write_json("state.json", {"step": step})
    return pending.commit({"epoch": 0, "samples_seen": 0, "fingerprint": "f" * 32,
                           "metrics": {}, "info": {}})


OTHER = crypt.EncryptionKey(bytes.fromhex(OTHER_HEX))


def _pick(tmp_path, monkeypatch, key_hex):
    """A scripted launch (no process) of a run that trains once and finishes: its exit code
    and events."""
    from scripted_loop import Script, run, success

    for k in [k for k in os.environ if k.startswith("RTRAIN_")]:
        monkeypatch.delenv(k)
    if key_hex:
        monkeypatch.setenv("RTRAIN_ENCRYPTION_KEY", key_hex)
    script = Script([success()])
    code, evs = run(tmp_path, script)
    return code, evs, script


@pytest.mark.parametrize("own", ["encrypted", "plaintext"])
def test_a_newer_checkpoint_of_another_key_is_skipped_with_the_reason(tmp_path, monkeypatch,
                                                                      own):
    """The run's own checkpoints open with its key (or need none); a newer one sealed under
    another key was dropped in: skipped like any unusable checkpoint, the run resumes from its
    own newest."""
    ckpts = tmp_path / "run" / "checkpoints"
    if own == "encrypted":
        _encrypted(ckpts, 3)
    else:
        _plain(ckpts, 3)
    _encrypted(ckpts, 7, OTHER)
    code, evs, script = _pick(tmp_path, monkeypatch, KEY_HEX if own == "encrypted" else None)
    assert code == 0
    launch = next(e for e in evs if e["kind"] == "launch")
    assert launch["resume_from"].endswith("checkpoint-3")
    skipped = [e for e in evs if e["kind"] == "skipped_checkpoint"]
    assert [Path(e["path"]).name for e in skipped] == ["checkpoint-7"]
    assert skipped[0]["reason"].startswith(
        f"wrong_key: encrypted with the key of fingerprint {OTHER.fingerprint}")
    assert any(line.startswith("skipping checkpoint-7: wrong_key") for line in script.said)


@pytest.mark.parametrize("older,key_hex", [
    ("none", KEY_HEX),  # nothing else in the dir
    ("other", KEY_HEX),  # every checkpoint under the other key: the run's own, a wrong key
    ("plaintext", KEY_HEX),  # older plaintext: not what a run with this key writes
    ("encrypted", None),  # no key given for checkpoints that all need one
])
def test_when_none_of_the_run_s_checkpoints_opens_the_launch_stops(tmp_path, monkeypatch, older,
                                                                   key_hex):
    from rtrain.supervisor.core.errors import UsageError

    ckpts = tmp_path / "run" / "checkpoints"
    if older == "other":
        _encrypted(ckpts, 3, OTHER)
    elif older == "plaintext":
        _plain(ckpts, 3)
    elif older == "encrypted":
        _encrypted(ckpts, 3)
    _encrypted(ckpts, 7, OTHER if key_hex else KEY)
    with pytest.raises(UsageError, match=r"^cannot resume from checkpoint-7: encrypted with") as e:
        _pick(tmp_path, monkeypatch, key_hex)
    assert (OTHER if key_hex else KEY).fingerprint in str(e.value)
    assert not events(tmp_path / "run", "launch")
