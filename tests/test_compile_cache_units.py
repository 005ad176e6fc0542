"""The compile cache's rules, in-process: when a checkpoint's compile cache may be loaded
(worker/compilecache/compile_cache.judge), the container it travels in
(worker/compilecache/compile_pack.py), where attempts keep their compile caches
(supervisor/compilecache/dirs.py), and a forged cache that verifies but that torch cannot take:
ignored, the checkpoint still restores."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hostile import make, manifest, relist, write_manifest

import rtrain
from rtrain.checkpoint import hashing
from rtrain.checkpoint.manifest import sign_manifest
from rtrain.supervisor.compilecache import dirs as compile_dirs
from rtrain.worker.compilecache import compile_cache, compile_pack

HERE = {"torch": torch.__version__, "device": "cpu/x86_64"}


def listed(size: int = 10, **info: object) -> dict:
    return {"files": {compile_cache.FILE: {"size": size, "hash": "h"}},
            "info": {compile_cache.INFO_KEY: {**HERE, **info}}}


@pytest.mark.parametrize("m, signed, trust, why", [
    (listed(), True, False, None),
    (listed(), False, True, None),
    (listed(), False, False, "not signed"),
    (listed(torch="2.0.0"), True, False, "written by torch '2.0.0'"),
    (listed(device="cuda/sm_90"), True, False, "built for 'cuda/sm_90'"),
    (listed(size=2 << 20), True, False, "over Saving(compile_cache_max_mb=)"),
    ({"files": {}, "info": {compile_cache.INFO_KEY: HERE}}, True, False, "does not list"),
    ({"files": {compile_cache.FILE: {"size": 1}}, "info": {}}, True, True, "does not list"),
])
def test_judge(m, signed, trust, why):
    got = compile_cache.judge(m, signed=signed, allow_pickle=trust, torch_version=HERE["torch"],
                              device=HERE["device"], max_bytes=1 << 20)
    assert (got is None) if why is None else (why in got), got


def test_pack_round_trip():
    kernels = {"inductor/ab/cabc.so": b"\x7fELF", "inductor/ab/cabc.cpp": b"int x;"}
    assert compile_pack.unpack(compile_pack.pack(b"torch bytes", kernels)) == (
        b"torch bytes", kernels)


def _entry(name: bytes, data: bytes) -> bytes:
    return (len(name).to_bytes(2, "little") + name + len(data).to_bytes(8, "little") + data)


@pytest.mark.parametrize("data, why", [
    (b"not ours", "header"),
    (compile_pack.MAGIC + _entry(b"torch", b"x")[:-1], "more bytes"),
    (compile_pack.MAGIC + _entry(b"torch", b"x") + b"\x05", "cut short"),
    (compile_pack.MAGIC + _entry(b"torch", b"x") + _entry(b"inductor/ab/../../evil", b"x"),
     "not a name"),
    (compile_pack.MAGIC + _entry(b"torch", b"x") + _entry(b"/etc/passwd", b"x"), "not a name"),
    (compile_pack.MAGIC + _entry(b"torch", b"x") + _entry(b"inductor/ab/.hidden", b"x"),
     "not a name"),
    (compile_pack.MAGIC + _entry(b"inductor/ab/k.so", b"x"), "no torch"),
    (compile_pack.MAGIC + _entry(b"torch", b"x") + _entry(b"torch", b"y"), "not a name"),
])
def test_unpack_refuses(data, why):
    with pytest.raises(compile_pack.PackError, match=why):
        compile_pack.unpack(data)


def test_place_writes_inside_and_keeps_what_is_there(tmp_path):
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "old.so").write_bytes(b"kept")
    n = compile_pack.place(tmp_path, {"inductor/ab/old.so": b"new", "inductor/cd/k.so": b"k",
                                      "elsewhere/../../x": b"never"})
    assert n == 1
    assert (tmp_path / "ab" / "old.so").read_bytes() == b"kept"
    assert (tmp_path / "cd" / "k.so").read_bytes() == b"k"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["k.so", "old.so"]
    assert [n for n, _ in compile_pack.kernel_files(tmp_path)] == [
        "inductor/ab/old.so", "inductor/cd/k.so"]


def test_attempts_share_the_run_dirs_compile_cache(tmp_path):
    env = compile_dirs.cache_env(tmp_path / "run", {})
    root = (tmp_path / "run").resolve() / "compile-cache"
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
                   "TRITON_CACHE_DIR": str(root / "triton")}
    # A cache dir the user chose stays theirs.
    assert compile_dirs.cache_env(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": "/mine"}) == {
        "TRITON_CACHE_DIR": str(root.parent.parent / "compile-cache" / "triton")}


def test_saving_refuses_a_size_limit_that_is_not_positive():
    with pytest.raises(ValueError, match="compile_cache_max_mb"):
        rtrain.Saving(compile_cache_max_mb=0)


def _forge(ckpt: Path, data: bytes, key: bytes | None, **info: object) -> None:
    relist(ckpt, compile_cache.FILE, data)
    m = manifest(ckpt)
    m["info"][compile_cache.INFO_KEY] = {**HERE, "device": compile_cache.device_kind(None),
                                         "bytes": len(data), **info}
    m.pop("signature", None)
    if key is not None:
        sign_manifest(m, key)
    write_manifest(ckpt, m)


@pytest.mark.parametrize("data, signed, why", [
    (compile_pack.pack(b"\0" * 16, {}), True, "torch could not parse it"),
    (b"junk that hashes right", True, "not a compile cache rtrain wrote"),
    (compile_pack.pack(b"\0" * 16, {}), False, "not signed"),
])
def test_a_cache_torch_cannot_take_is_ignored_and_the_checkpoint_restores(
        tmp_path, caplog, monkeypatch, data, signed, why):
    # inductor writes its cache dir into os.environ when it first resolves it: kept to this
    # test, or every later child of this process would inherit it as the user's own.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    key = hashing.derive_key(b"k")
    model, opt = make()
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path, signing_key=key)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ck.save(2)
    saved = model.weight.detach().clone()
    _forge(tmp_path / "checkpoint-2", data, key if signed else None)
    model2, opt2 = make(seed=1)
    ck2 = rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                              signing_key=key if signed else None)
    caplog.set_level(logging.INFO, logger="rtrain.worker.compilecache.compile_cache")
    assert ck2.restore() == 2
    assert torch.equal(model2.weight, saved)
    assert why in caplog.text and "compiles cold" in caplog.text


def test_inspect_shows_the_compile_caches_size(tmp_path):
    from harness import invoke_rtrain

    model, opt = make()
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path).save(2)
    data = compile_pack.pack(b"\0" * 3000, {})
    _forge(tmp_path / "checkpoint-2", data, None, artifacts={"inductor": 2}, kernels=5)
    r = invoke_rtrain("inspect", str(tmp_path / "checkpoint-2"))
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if "compile cache" in ln]
    assert f"torch {torch.__version__}" in line and "2 artifacts, 5 kernels" in line
    assert "KiB" in line or "kB" in line
    assert "compile_cache" not in r.stdout  # not repeated inside `info`


def test_the_mirror_carries_the_compile_cache(tmp_path):
    """A fresh machine resuming from the mirror gets the compile cache with the checkpoint:
    it is one of the manifest's files, uploaded and fetched (and verified) like the others."""
    from rtrain.checkpoint.verify import Level, verify
    from rtrain.supervisor.mirror import transfer
    from rtrain.supervisor.mirror.store import open_mirror

    key = hashing.derive_key(b"k")
    model, opt = make()
    rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path / "a",
                        signing_key=key).save(2)
    data = compile_pack.pack(b"\1" * 5000, {"inductor/ab/k.so": b"kernel"})
    _forge(tmp_path / "a" / "checkpoint-2", data, key)
    mirror = open_mirror(f"file://{tmp_path / 'mirror'}")
    transfer.upload(mirror, tmp_path / "a" / "checkpoint-2")
    (tmp_path / "fresh").mkdir()
    transfer.download(mirror, "checkpoint-2", tmp_path / "fresh", key=key)
    got = tmp_path / "fresh" / "checkpoint-2"
    assert (got / compile_cache.FILE).read_bytes() == data
    assert verify(got, Level.FULL, key).ok


def test_the_standby_preloads_the_compile_path_only_for_scripts_that_compile(tmp_path):
    from rtrain.supervisor.standby import child_program

    plain, compiled = tmp_path / "plain.py", tmp_path / "compiled.py"
    plain.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n")
    compiled.write_text("import torch\nmodel = torch.compile(torch.nn.Linear(2, 2))\n")
    assert not child_program.compiles({str(plain)})
    assert child_program.compiles({str(plain), str(compiled)})
    assert not child_program.compiles({str(tmp_path / "gone.py")})
