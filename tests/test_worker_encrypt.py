"""Encrypted checkpoints through the Checkpointer, in-process: every file sealed, the manifest
readable and verifiable without the key, restore with the key, without it, with another one,
tampering, async saves, tensor names left out of the manifest."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import rtrain
from rtrain.checkpoint import crypt, encrypted_file
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import verify
from rtrain.supervisor.core.errors import CorruptCheckpoint, KeyMismatch

KEY = "5a" * 32
OTHER = "a5" * 32


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = model(torch.randn(3, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    return model, opt


pytestmark = pytest.mark.usefixtures("unsupervised")


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def test_every_file_is_sealed_and_the_manifest_says_by_which_key(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRAIN_ENCRYPTION_KEY", KEY)
    model, opt = make()
    path = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).save(
        5, extra={"note": "a plaintext marker"})
    m = json.loads((path / "manifest.json").read_text())
    fp = crypt.EncryptionKey.from_material(KEY).fingerprint
    assert m["encryption"] == {"scheme": crypt.SCHEME, "key_fingerprint": fp,
                               "chunk_size": encrypted_file.CHUNK}
    assert KEY not in (path / "manifest.json").read_text()
    assert "0.weight" in m["tensors"]["model.safetensors"]  # names readable by default
    for name in m["files"]:
        data = (path / name).read_bytes()
        assert data.startswith(encrypted_file.MAGIC), name
        assert b"0.weight" not in data and b"a plaintext marker" not in data
    # Sizes and hashes are of the ciphertext: verification needs no key.
    assert verify(path, "full").ok


def test_round_trip_with_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRAIN_ENCRYPTION_KEY", KEY)
    model, opt = make()
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).save(
        5, extra={"t": torch.arange(3)})
    model2, opt2 = make(seed=1)
    ck = rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path)
    assert ck.restore() == 5
    assert _same(model, model2) and torch.equal(ck.extra["t"], torch.arange(3))


@pytest.mark.parametrize("key", [None, OTHER])
def test_no_key_or_another_key_is_one_line_naming_the_fingerprints(tmp_path, monkeypatch, key):
    model, opt = make()
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                        encryption_key=KEY).save(3)
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                        encryption_key=KEY).save(4)
    model2, opt2 = make(seed=1)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    ck = rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                             encryption_key=key)
    # Never a silent fresh start, never a fall-back to an older checkpoint with the same key.
    with pytest.raises(KeyMismatch) as e:
        ck.restore()
    reason = e.value.reason
    assert crypt.EncryptionKey.from_material(KEY).fingerprint in reason and "\n" not in reason
    if key is not None:
        assert crypt.EncryptionKey.from_material(key).fingerprint in reason
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


@pytest.mark.parametrize("own", [KEY, None])
def test_by_hand_a_newer_checkpoint_of_another_key_is_skipped(tmp_path, own, caplog):
    """Run by hand: the run's own checkpoints open (its key, or plaintext with none); a newer
    one sealed under another key was dropped in: skipped with the reason, never a KeyMismatch
    that stops the script; with only the other key's, the KeyMismatch stays."""
    model, opt = make()
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                        encryption_key=own).save(3)
    other_model, other_opt = make(seed=2)
    rtrain.Checkpointer(model=other_model, optimizer=other_opt, ckpt_dir=tmp_path,
                        encryption_key=OTHER).save(9)
    model2, opt2 = make(seed=1)
    ck = rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                             encryption_key=own)
    assert ck.restore() == 3 and _same(model, model2)
    assert "skipping checkpoint-9" in caplog.text
    assert crypt.EncryptionKey.from_material(OTHER).fingerprint in caplog.text
    third = "c3" * 32  # opens neither: the run's own need another key
    with pytest.raises(KeyMismatch, match="checkpoint-9"):
        rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                            encryption_key=third).restore()


def test_key_mismatch_under_rtrain_is_a_bad_checkpoint_exit(tmp_path, monkeypatch):
    model, opt = make()
    path = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                               encryption_key=KEY).save(3)
    monkeypatch.setenv("RTRAIN_RESUME_FROM", str(path))
    monkeypatch.setenv("RTRAIN_STATUS", str(tmp_path / "attempt"))
    (tmp_path / "attempt").mkdir()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                             encryption_key=OTHER)
    with pytest.raises(SystemExit) as e:
        ck.restore()
    assert e.value.code == 65
    record = json.loads(next((tmp_path / "attempt").glob("exit-*.json")).read_text())
    assert record["kind"] == "bad_checkpoint" and "fingerprint" in record["reason"]


@pytest.mark.parametrize("victim", ["model.safetensors", "state.json"])
def test_one_changed_byte_is_detected_on_load(tmp_path, victim):
    model, opt = make()
    path = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                               encryption_key=KEY).save(3)
    f = path / victim
    data = bytearray(f.read_bytes())
    data[encrypted_file.HEADER_SIZE + 3] ^= 0x40
    f.write_bytes(bytes(data))
    assert not verify(path, "full").ok  # the ciphertext's hash, without the key
    # A writer who also fixed the manifest's hash is caught by the tag.
    m = json.loads((path / "manifest.json").read_text())
    from rtrain.checkpoint.hashing import hash_file
    m["files"][victim]["hash"] = hash_file(f, m["hash_alg"])
    (path / "manifest.json").write_text(json.dumps(m))
    assert verify(path, "full").ok
    ck = rtrain.Checkpointer(model=make(1)[0], optimizer=None, ckpt_dir=tmp_path,
                             encryption_key=KEY)
    with pytest.raises(CorruptCheckpoint, match="fails authentication") as e:
        ck.restore(path)
    assert not isinstance(e.value, KeyMismatch)


def test_tensor_names_can_be_left_out_of_the_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRAIN_ENCRYPT_METADATA", "1")
    model, opt = make()
    path = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                               encryption_key=KEY).save(3)
    text = (path / "manifest.json").read_text()
    m = json.loads(text)
    assert "tensors" not in m and m["encryption"]["tensors_listed"] is False
    assert "0.weight" not in text
    model2, opt2 = make(seed=1)
    assert rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                               encryption_key=KEY).restore() == 3
    assert _same(model, model2)


def test_a_large_file_spans_many_chunks(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(1500, 1500)  # 9 MB of weights: three chunks, an unaligned tail
    rtrain.Checkpointer(model=model, ckpt_dir=tmp_path, encryption_key=KEY).save(1)
    model2 = nn.Linear(1500, 1500)
    assert rtrain.Checkpointer(model=model2, ckpt_dir=tmp_path,
                               encryption_key=KEY).restore() == 1
    assert _same(model, model2)


@pytest.mark.parametrize("mode", [pytest.param("fork", marks=pytest.mark.slow), "thread"])
def test_async_saves_are_encrypted(tmp_path, mode):
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path,
                             saving=rtrain.Saving(async_mode=mode), encryption_key=KEY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(1)
    ck.close()
    [(_, path)] = list_checkpoints(tmp_path)
    assert (path / "model.safetensors").read_bytes().startswith(encrypted_file.MAGIC)
    assert json.loads((path / "manifest.json").read_text())["encryption"]
    model2, _ = make(seed=3)
    rtrain.Checkpointer(model=model2, ckpt_dir=tmp_path, encryption_key=KEY).restore()
    assert all(torch.equal(v, before[k]) for k, v in model2.state_dict().items())


def test_missing_cryptography_is_one_line(tmp_path, monkeypatch):
    def missing():
        raise crypt.MissingCipher(f"checkpoint encryption needs the cryptography package: "
                                  f"{crypt.INSTALL_HINT}")

    monkeypatch.setattr(crypt, "cipher", missing)
    from rtrain.supervisor.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"pip install 'rtrain\[encrypt\]'"):
        rtrain.Checkpointer(model=make()[0], ckpt_dir=tmp_path, encryption_key=KEY)
