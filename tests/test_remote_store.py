"""The mirror (supervisor/mirror/) against a real S3 endpoint (moto's server, a process:
slow) and a plain directory (a shared filesystem: fast), with the same tests."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from conftest import build_checkpoint

from rtrain.checkpoint import layout
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.hashing import derive_key, new_hasher
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.mirror import backend, transfer
from rtrain.supervisor.mirror.cache import BlobCache
from rtrain.supervisor.mirror.store import (
    CorruptLocal,
    CorruptRemote,
    MirrorError,
    RemoteCheckpoint,
    open_mirror,
)
from rtrain.supervisor.mirror.url import redact


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "local"])
def mirror(request, tmp_path):
    if request.param == "s3":
        url, _ = request.getfixturevalue("s3_mirror")
    else:
        url = str(tmp_path / "mirror")
    return open_mirror(url)


@pytest.fixture
def ckpt(tmp_path):
    """checkpoint-100 with a file in a subdirectory, as a sharded save writes them."""
    pending = PendingCheckpoint(tmp_path / "local", 100, fsync=False)
    pending.write_json("state.json", {"step": 100})
    pending.write_bytes("model.safetensors", os.urandom(1000))
    data = os.urandom(100_000)
    (pending.tmp / "shard").mkdir()
    (pending.tmp / "shard" / "extra.bin").write_bytes(data)
    h = new_hasher()
    h.update(data)
    pending.add_file("shard/extra.bin", len(data), h.hexdigest())
    return pending.commit({"epoch": 1, "samples_seen": 3200, "metrics": {"loss": 0.5}})


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def overwrite(mirror, name: str, member: str, data: bytes) -> None:
    mirror.fs.pipe_file(mirror.path(name, member), data)


def test_upload_list_read_download_round_trip(mirror, ckpt, tmp_path):
    sent = mirror.upload(ckpt)
    assert sent.files == 4 and sent.bytes == sum(len(b) for b in tree(ckpt).values())
    assert mirror.list() == [RemoteCheckpoint(100, "checkpoint-100", True)]
    m = mirror.read_manifest("checkpoint-100")
    assert m["step"] == 100 and set(m["files"]) == {"model.safetensors", "state.json",
                                                    "shard/extra.bin"}
    got = mirror.download("checkpoint-100", tmp_path / "fresh")
    final = tmp_path / "fresh" / "checkpoint-100"
    assert got.bytes == sent.bytes and got.cached_bytes == 0
    assert verify(final, Level.FULL).ok
    assert tree(final) == tree(ckpt)
    assert oct(os.stat(final / "state.json").st_mode & 0o777) == "0o600"
    assert not layout.list_leftovers(tmp_path / "fresh")  # no temp dir left behind


def test_uploading_again_sends_nothing(mirror, ckpt):
    mirror.upload(ckpt)
    assert mirror.upload(ckpt).bytes == 0


def test_newest_first_and_unfinished_uploads_listed_as_not_committed(mirror, tmp_path):
    for step in (5, 300, 20):
        mirror.upload(build_checkpoint(tmp_path / "local", step))
    overwrite(mirror, "checkpoint-400", "state.json", b"{}")  # an upload that died
    overwrite(mirror, "not-a-checkpoint", "x", b"x")
    overwrite(mirror, "checkpoint-007", "x", b"x")  # not a name local layout accepts
    assert mirror.list() == [RemoteCheckpoint(400, "checkpoint-400", False),
                             RemoteCheckpoint(300, "checkpoint-300", True),
                             RemoteCheckpoint(20, "checkpoint-20", True),
                             RemoteCheckpoint(5, "checkpoint-5", True)]
    with pytest.raises(CorruptRemote, match=r"no manifest\.json"):
        mirror.download("checkpoint-400", tmp_path / "fresh")


def test_reupload_into_an_unfinished_dir_overwrites_it(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    mirror.fs.rm(mirror.path("checkpoint-100", "manifest.json"))
    overwrite(mirror, "checkpoint-100", "state.json", b"garbage from the upload that died")
    mirror.upload(ckpt)
    mirror.download("checkpoint-100", tmp_path / "fresh")
    assert verify(tmp_path / "fresh" / "checkpoint-100", Level.FULL).ok


def test_a_remote_file_with_other_bytes_is_refused_and_nothing_kept(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    data = (ckpt / "shard" / "extra.bin").read_bytes()
    overwrite(mirror, "checkpoint-100", "shard/extra.bin", bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(CorruptRemote, match=r"shard/extra.bin: hash mismatch") as e:
        mirror.download("checkpoint-100", tmp_path / "fresh")
    assert e.value.name == "checkpoint-100"
    assert os.listdir(tmp_path / "fresh") == []  # neither the checkpoint nor its temp dir


def test_a_truncated_remote_file_is_refused(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    overwrite(mirror, "checkpoint-100", "state.json", b"{")
    with pytest.raises(CorruptRemote, match=r"state.json: has 1 bytes, the manifest says"):
        mirror.download("checkpoint-100", tmp_path / "fresh")


def test_a_manifest_naming_a_file_outside_is_refused(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    raw = mirror.read_manifest_bytes("checkpoint-100").replace(b'"state.json"',
                                                               b'"../../state.json"')
    overwrite(mirror, "checkpoint-100", "manifest.json", raw)
    with pytest.raises(CorruptRemote, match="leaves the checkpoint directory"):
        mirror.download("checkpoint-100", tmp_path / "a" / "b")
    assert not (tmp_path / "state.json").exists()
    assert os.listdir(tmp_path / "a" / "b") == []


def test_a_remote_manifest_that_is_not_one_is_refused(mirror, ckpt):
    mirror.upload(ckpt)
    overwrite(mirror, "checkpoint-100", "manifest.json", b"[" * 100 + b"]" * 100)
    with pytest.raises(CorruptRemote, match="nested more than"):
        mirror.read_manifest("checkpoint-100")


def test_signed_checkpoint_needs_the_key_that_signed_it(mirror, tmp_path):
    key = derive_key(b"right")
    mirror.upload(build_checkpoint(tmp_path / "local", 100, key=key))
    with pytest.raises(CorruptRemote, match="signature does not match"):
        mirror.download("checkpoint-100", tmp_path / "a", key=derive_key(b"wrong"))
    mirror.download("checkpoint-100", tmp_path / "b", key=key)
    assert verify(tmp_path / "b" / "checkpoint-100", Level.FULL, key).ok


def test_a_damaged_local_checkpoint_is_not_uploaded(mirror, ckpt):
    path = ckpt / "shard" / "extra.bin"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptLocal, match=r"shard/extra.bin: hash mismatch"):
        mirror.upload(ckpt)
    assert mirror.list() in ([], [RemoteCheckpoint(100, "checkpoint-100", False)])


def test_delete_removes_the_manifest_first(mirror, ckpt):
    mirror.upload(ckpt)
    removed = []
    rm = mirror.fs.rm

    def recording_rm(path, recursive=False, **kw):
        removed.append(path.rsplit("/", 1)[-1] if not recursive else "<dir>")
        return rm(path, recursive=recursive, **kw)

    mirror.fs.rm = recording_rm
    mirror.delete("checkpoint-100")
    assert removed == ["manifest.json", "<dir>"]
    assert mirror.list() == []
    mirror.delete("checkpoint-100")  # already gone: nothing to do


def test_probe_leaves_nothing_behind(mirror):
    mirror.probe()
    assert mirror.fs.find(mirror.root) == []


def test_cache_and_local_checkpoints_spare_downloads(mirror, tmp_path):
    frozen = os.urandom(200_000)  # unchanged from one checkpoint to the next
    for step in (100, 200):
        mirror.upload(build_checkpoint(tmp_path / "local", step, files={"frozen.bin": frozen}))
    cache = BlobCache(tmp_path / "cache")
    first = mirror.download("checkpoint-100", tmp_path / "a", cache=cache)
    assert first.cached_bytes == 0
    again = mirror.download("checkpoint-100", tmp_path / "b", cache=cache)
    size = sum(e["size"] for e in mirror.read_manifest("checkpoint-100")["files"].values())
    assert again.cached_bytes == size and again.files == 1  # the manifest only
    # No cache at all: the frozen file is taken from checkpoint-100 already in the dir.
    nxt = mirror.download("checkpoint-200", tmp_path / "a")
    assert nxt.cached_bytes == len(frozen)
    assert verify(tmp_path / "a" / "checkpoint-200", Level.FULL).ok


def test_a_damaged_cache_blob_is_downloaded_instead(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    cache = BlobCache(tmp_path / "cache")
    mirror.download("checkpoint-100", tmp_path / "a", cache=cache)
    for _, _, path in cache.entries():
        os.unlink(path)  # a hard link may share the checkpoint's inode: write a new file
        path.write_bytes(b"not the blob")
    got = mirror.download("checkpoint-100", tmp_path / "b", cache=cache)
    assert got.cached_bytes == 0
    assert verify(tmp_path / "b" / "checkpoint-100", Level.FULL).ok


def test_a_local_checkpoint_that_verifies_is_kept(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    mirror.download("checkpoint-100", tmp_path / "a")
    ino = os.stat(tmp_path / "a" / "checkpoint-100" / "state.json").st_ino
    got = mirror.download("checkpoint-100", tmp_path / "a")
    assert got.bytes == 0
    assert os.stat(tmp_path / "a" / "checkpoint-100" / "state.json").st_ino == ino


def test_a_damaged_local_checkpoint_of_that_step_is_not_replaced(mirror, ckpt, tmp_path):
    mirror.upload(ckpt)
    local = build_checkpoint(tmp_path / "a", 100)
    (local / "state.json").write_text('{"step": 1}')
    with pytest.raises(MirrorError, match=r"fails verification.*move it away"):
        mirror.download("checkpoint-100", tmp_path / "a")
    assert (local / "state.json").read_text() == '{"step": 1}'


def test_names_that_are_not_checkpoints_are_refused(mirror):
    with pytest.raises(MirrorError, match="not a checkpoint name"):
        mirror.read_manifest("../checkpoint-1")


@pytest.mark.slow
def test_large_files_go_up_in_parts(s3_mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "PART_BYTES", 5 << 20)  # S3's smallest part
    url, _ = s3_mirror
    mirror = open_mirror(url)
    ckpt = build_checkpoint(tmp_path / "local", 1, files={"big.bin": os.urandom(12 << 20)})
    mirror.upload(ckpt)
    etag = mirror.fs.info(mirror.path("checkpoint-1", "big.bin"))["ETag"]
    parts = etag.strip('"').rpartition("-")[2]  # a multipart upload's ETag counts its parts
    assert parts.isdigit() and int(parts) >= 2
    mirror.download("checkpoint-1", tmp_path / "fresh")
    assert verify(tmp_path / "fresh" / "checkpoint-1", Level.FULL).ok


@pytest.mark.slow
def test_wrong_credentials_are_one_line_naming_credentials_without_the_secret(monkeypatch):
    from s3server import S3Server

    server = S3Server(auth=True).start()
    try:
        for k, v in server.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-never-shown")
        with pytest.raises(MirrorError) as e:
            open_mirror("s3://rtrain-test/runs").probe()
    finally:
        server.stop()
    msg = str(e.value)
    assert msg.startswith("mirror s3://rtrain-test/runs: cannot write (InvalidAccessKeyId)")
    assert "AWS_ACCESS_KEY_ID" in msg and "\n" not in msg
    assert "s3cr3t" not in msg and "testing" not in msg


@pytest.mark.slow
def test_a_dead_endpoint_fails_within_the_timeouts_and_recovers(s3_mirror, s3_server, ckpt):
    url, _ = s3_mirror
    s3_server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(MirrorError, match="does not answer: check AWS_ENDPOINT_URL"):
            open_mirror(url).upload(ckpt)
        assert time.monotonic() - t0 < 60
    finally:
        s3_server.start()  # same port; moto's memory is gone, the bucket made again
    mirror = open_mirror(url)
    mirror.probe()
    mirror.upload(ckpt)
    assert mirror.list() == [RemoteCheckpoint(100, "checkpoint-100", True)]


def test_credentials_in_a_url_are_never_shown(tmp_path):
    m = open_mirror(f"file://{tmp_path}/m")
    assert m.display == f"file://{tmp_path}/m"
    assert redact("s3://AKIA:hunter2@bucket/p?X-Amz-Signature=abc") == "s3://bucket/p"


def test_a_missing_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)
    with pytest.raises(MirrorError, match=r"s3fs is not installed: pip install 'rtrain\[s3\]'"):
        open_mirror("s3://bucket/prefix")
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(MirrorError, match=r"fsspec is not installed \(every mirror needs it, "
                                          r"a local directory too\)"):
        open_mirror("/shared/ckpts")


def test_a_bucketless_url_is_refused():
    with pytest.raises(MirrorError, match="name a bucket"):
        open_mirror("s3://")


@pytest.mark.slow  # not a process, but ~10 s of waiting on purpose
def test_an_endpoint_that_accepts_and_never_answers_times_out(monkeypatch):
    import socket

    timeouts = backend.Timeouts(read_s=1)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # connections complete in the backlog; nothing is ever read or sent
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{silent.getsockname()[1]}")
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        t0 = time.monotonic()
        with pytest.raises(MirrorError, match=r"cannot write.*does not answer"):
            open_mirror("s3://bucket/prefix", timeouts=timeouts).probe()
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    assert timeouts.worst_case_s() <= elapsed < timeouts.worst_case_s() + 30  # plus backoffs


def test_credentials_in_an_s3_url_are_refused_unshown():
    with pytest.raises(MirrorError, match="credentials in the URL are not read") as e:
        open_mirror("s3://AKIA:hunter2@bucket/prefix")
    assert "hunter2" not in str(e.value) and "AKIA" not in str(e.value)


def test_a_fifo_in_a_shared_directory_mirror_is_never_opened(tmp_path, ckpt):
    mirror = open_mirror(str(tmp_path / "mirror"))
    mirror.upload(ckpt)
    target = tmp_path / "mirror" / "checkpoint-100" / "state.json"
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(CorruptRemote, match=r"state\.json is a FIFO"):
        mirror.download("checkpoint-100", tmp_path / "fresh")


def test_a_fifo_in_a_local_checkpoint_is_no_source(tmp_path):
    mirror = open_mirror(str(tmp_path / "mirror"))
    frozen = os.urandom(1000)
    for step in (100, 200):
        mirror.upload(build_checkpoint(tmp_path / "local", step, files={"frozen.bin": frozen}))
    mirror.download("checkpoint-100", tmp_path / "a")
    planted = tmp_path / "a" / "checkpoint-100" / "frozen.bin"
    planted.unlink()
    os.mkfifo(planted)
    got = mirror.download("checkpoint-200", tmp_path / "a")
    assert got.cached_bytes == 0  # fetched, not read from the FIFO (nor hung on it)
    assert verify(tmp_path / "a" / "checkpoint-200", Level.FULL).ok
