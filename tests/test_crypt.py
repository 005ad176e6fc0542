"""The encrypted file format (checkpoint/encrypted_file.py) and its key (crypt.py): round
trips, wrong keys, tampering, truncation, reordered chunks, and the key's loading rules."""

from __future__ import annotations

import os

import pytest

from rtrain.checkpoint import crypt, encrypted_file
from rtrain.checkpoint.crypt import CryptError, EncryptionKey
from rtrain.checkpoint.encrypted_file import Decryptor
from rtrain.supervisor.core.errors import UsageError

KEY = EncryptionKey(bytes(range(32)))
OTHER = EncryptionKey(bytes(range(1, 33)))
SMALL = 64  # a tiny chunk size, so a few hundred bytes make several chunks


class _Raw:
    """A ListedFile stand-in over bytes: size, in-order reads, finish."""

    def __init__(self, data: bytes) -> None:
        self.data, self.size, self.pos, self.finished = data, len(data), 0, False

    def readinto(self, buf: memoryview) -> None:
        n = buf.nbytes
        assert self.pos + n <= self.size
        buf[:] = self.data[self.pos:self.pos + n]
        self.pos += n

    def read(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def finish(self) -> None:
        assert self.pos == self.size
        self.finished = True

    def close(self) -> None:
        pass


def _seal(data: bytes, key: EncryptionKey = KEY, name: str = "model.safetensors",
          chunk: int = SMALL, pieces: int = 1) -> bytes:
    out: list[bytes] = []
    enc = encrypted_file.Encryptor(key, name, lambda v: out.append(bytes(v)), chunk)
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        enc.update(data[i:i + step])
    enc.finish()
    return b"".join(out)


def _open(ct: bytes, key: EncryptionKey = KEY, name: str = "model.safetensors",
          reads: tuple[int, ...] = ()) -> bytes:
    raw = _Raw(ct)
    d = Decryptor(raw, key, name)
    got = bytearray()
    for n in reads:
        got += d.read(n)
    got += d.read(d.size - d.pos)
    d.finish()
    assert raw.finished
    return bytes(got)


@pytest.mark.parametrize("size", [0, 1, SMALL - 1, SMALL, SMALL + 1, 5 * SMALL, 5 * SMALL + 7])
@pytest.mark.parametrize("pieces", [1, 3, 50])
def test_round_trip(size: int, pieces: int) -> None:
    data = os.urandom(size)
    ct = _seal(data, pieces=pieces)
    assert len(ct) == encrypted_file.sealed_size(size, SMALL)
    assert encrypted_file.plain_size(len(ct), SMALL) == size
    assert _open(ct) == data
    assert _open(ct, reads=(3, SMALL, 1)) == data if size >= SMALL + 4 else True


def test_default_chunk_round_trip_with_sealing_thread() -> None:
    data = os.urandom(3 * encrypted_file.CHUNK + 123)
    ct = encrypted_file.seal_bytes(KEY, "x", data)
    assert _open(ct, name="x") == data


def test_the_same_plaintext_seals_differently_each_time() -> None:
    data = b"a" * 200
    assert _seal(data) != _seal(data)  # a fresh salt, so a fresh file key, per file


def test_wrong_key_is_named() -> None:
    ct = _seal(b"secret" * 40)
    with pytest.raises(CryptError, match=f"fingerprint {KEY.fingerprint}, not {OTHER.fingerprint}"):
        _open(ct, key=OTHER)


def test_one_flipped_byte_of_ciphertext_is_detected() -> None:
    ct = bytearray(_seal(os.urandom(4 * SMALL)))
    ct[encrypted_file.HEADER_SIZE + SMALL + encrypted_file.TAG + 20] ^= 1  # in chunk 1
    with pytest.raises(CryptError, match="chunk 1 fails authentication"):
        _open(bytes(ct))


def test_a_changed_header_is_detected() -> None:
    ct = bytearray(_seal(os.urandom(4 * SMALL)))
    ct[encrypted_file.HEADER_SIZE - 1] ^= 1  # the salt: another file key
    with pytest.raises(CryptError, match="fails authentication"):
        _open(bytes(ct))


@pytest.mark.parametrize("cut", [1, encrypted_file.TAG, encrypted_file.TAG + 3,
                                 SMALL + encrypted_file.TAG])
def test_truncation_is_detected(cut: int) -> None:
    ct = _seal(os.urandom(3 * SMALL + 10))
    with pytest.raises(CryptError, match=r"truncated|fails authentication"):
        _open(ct[:-cut])


def test_dropping_an_empty_final_chunk_is_detected() -> None:
    ct = _seal(os.urandom(3 * SMALL))  # whole chunks: the final one is empty (a tag)
    with pytest.raises(CryptError):
        _open(ct[:-encrypted_file.TAG])


def test_dropping_the_final_chunk_of_whole_chunks_is_detected() -> None:
    # Cut right after a full chunk: the layout then reads the last full chunk as the final one.
    ct = _seal(os.urandom(3 * SMALL + 5))
    cut = (encrypted_file.HEADER_SIZE + 2 * (SMALL + encrypted_file.TAG)
           + SMALL + encrypted_file.TAG - (SMALL - 5))
    with pytest.raises(CryptError):
        _open(ct[:cut])


def test_reordered_chunks_are_detected() -> None:
    ct = _seal(os.urandom(3 * SMALL + 10))
    h, c = encrypted_file.HEADER_SIZE, SMALL + encrypted_file.TAG
    swapped = ct[:h] + ct[h + c:h + 2 * c] + ct[h:h + c] + ct[h + 2 * c:]
    with pytest.raises(CryptError, match="chunk 0 fails authentication"):
        _open(swapped)


def test_a_file_renamed_within_the_checkpoint_is_detected() -> None:
    ct = _seal(os.urandom(100), name="model.safetensors")
    with pytest.raises(CryptError, match="fails authentication"):
        _open(ct, name="optimizer.safetensors")


def test_a_plaintext_file_is_not_taken_for_an_encrypted_one() -> None:
    with pytest.raises(CryptError, match="not an encrypted file"):
        _open(b"{" + b" " * 100 + b"}")
    with pytest.raises(CryptError, match="too short"):
        _open(b"{}")


def test_empty_file_round_trip_and_final_chunk_required() -> None:
    ct = _seal(b"")
    assert len(ct) == encrypted_file.HEADER_SIZE + encrypted_file.TAG
    assert _open(ct) == b""
    with pytest.raises(CryptError):
        _open(ct[:encrypted_file.HEADER_SIZE])


def test_reading_past_the_end_is_refused() -> None:
    d = Decryptor(_Raw(_seal(b"abc")), KEY, "model.safetensors")
    with pytest.raises(CryptError, match="past the end"):
        d.read(4)


# ---------------------------------------------------------------- keys


def test_hex_key_is_the_key_and_a_passphrase_is_stretched() -> None:
    hexkey = "ab" * 32
    assert EncryptionKey.from_material(hexkey).key == bytes.fromhex(hexkey)
    pw = EncryptionKey.from_material("correct horse battery staple")
    assert pw == EncryptionKey.from_material(b"correct horse battery staple\n")
    assert pw.key != EncryptionKey.from_material("correct horse battery stapler").key


def test_fingerprint_is_short_stable_and_not_the_key() -> None:
    assert len(KEY.fingerprint) == 16 and KEY.fingerprint == EncryptionKey(bytes(range(32))
                                                                           ).fingerprint
    assert KEY.fingerprint not in KEY.key.hex()
    assert KEY.fingerprint != OTHER.fingerprint
    assert KEY.key.hex() not in repr(KEY)


def test_load_from_env_and_file(tmp_path) -> None:
    assert crypt.load_encryption_key({}) is None
    k = crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY": "cd" * 32,
                                   "RTRAIN_ENCRYPT_METADATA": "1"})
    assert k is not None and k.key == bytes.fromhex("cd" * 32) and k.hide_tensors
    f = tmp_path / "key"
    f.write_text("cd" * 32 + "\n")
    f.chmod(0o600)
    k2 = crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY_FILE": str(f)})
    assert k2 is not None and k2.fingerprint == k.fingerprint


def test_key_file_modes_follow_the_signing_key_rules(tmp_path) -> None:
    f = tmp_path / "key"
    f.write_text("cd" * 32)
    f.chmod(0o644)
    with pytest.raises(UsageError, match=r"encryption key file .* accessible by group"):
        crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY_FILE": str(f)})
    assert crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY_FILE": str(f),
                                      "RTRAIN_ALLOW_SHARED_KEY": "1"}) is not None
    with pytest.raises(UsageError, match="cannot read the encryption key file"):
        crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY_FILE": str(tmp_path / "none")})
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0o600)
    with pytest.raises(UsageError, match="is empty"):
        crypt.load_encryption_key({"RTRAIN_ENCRYPTION_KEY_FILE": str(empty)})


def test_key_problem_names_both_fingerprints() -> None:
    m = {"encryption": crypt.manifest_entry(KEY, encrypted_file.CHUNK)}
    assert crypt.key_problem(m, KEY) is None
    assert crypt.key_problem({}, None) is None
    no_key = crypt.key_problem(m, None)
    assert no_key is not None and KEY.fingerprint in no_key and "\n" not in no_key
    wrong = crypt.key_problem(m, OTHER)
    assert wrong is not None and KEY.fingerprint in wrong and OTHER.fingerprint in wrong
    with pytest.raises(CryptError, match="upgrade rtrain"):
        crypt.key_problem({"encryption": {"scheme": "rot13", "key_fingerprint": "x"}}, KEY)


def test_the_encryption_key_is_a_secret_hooks_never_get() -> None:
    from rtrain.checkpoint.hashing import SECRET_ENV

    assert "RTRAIN_ENCRYPTION_KEY" in SECRET_ENV
