"""The memory tier's reused files (worker/memtier/shm_files.py): a snapshot written into the
files of the one before the one it replaces is still its step boundary, bitwise, and hashed
from what was written; a file rtrain pinned is never written again; a corrupted one is
refused; nothing is left behind by an earlier attempt, a drop or a changed state."""

from __future__ import annotations

import copy
import errno
import mmap
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import rtrain
from rtrain.checkpoint import safetensors_io
from rtrain.checkpoint.hashing import BLAKE3, XXH3
from rtrain.checkpoint.layout import TRASH_PREFIX, list_checkpoints, tmp_name
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.memtier import persist, shmdir
from rtrain.supervisor.memtier.tier import MemoryTierDir
from rtrain.worker.memtier import shm_files
from rtrain.worker.trainstate.tensors import to_blob


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                            torch.nn.Linear(64, 1))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _step(m, opt):
    loss = m(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _train(ckpt, m, opt, steps):
    """A training step and `maybe_save` for each of `steps`."""
    for step in steps:
        _step(m, opt)
        ckpt.maybe_save(step)


def _tier_ckpt(m, opt, tmp_path, **kw):
    return rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1), **kw)


def _inodes(snap: Path) -> dict[str, int]:
    return {f.name: f.stat().st_ino for f in snap.glob("*.safetensors")}


def _maps_of(d: Path) -> list[str]:
    """The shared mappings (the tier's own: safetensors' load_file maps privately) of files
    under `d` in this process's memory map."""
    with open("/proc/self/maps") as f:
        return [line for line in f if str(d) in line and line.split()[1].endswith("s")]


@pytest.mark.parametrize("alg", [XXH3, BLAKE3])
def test_a_file_filled_in_shared_memory_is_the_file_the_writer_writes(tmp_path, alg):
    """Byte for byte and hash for hash what safetensors_io.write_file makes of the same
    tensors: an empty one, a scalar, odd sizes, bool and bfloat16, one over a chunk."""
    tensors = {"a": torch.randn(3, 5), "empty": torch.empty(0), "s": torch.tensor(2.5),
               "b": torch.tensor([True, False, True]), "h": torch.randn(7).bfloat16(),
               "big": torch.randn(shm_files.CHUNK // 4 + 13)}
    blobs = [to_blob(n, t) for n, t in tensors.items()]
    meta = {"rng": "{}"}
    ref = safetensors_io.write_file(tmp_path / "ref", blobs, metadata=meta, fsync=False,
                                    hash_alg=alg)
    header = safetensors_io.build_header(blobs, meta)
    f = shm_files.create(tmp_path / "shm", len(header) + sum(b.data.nbytes for b in blobs))
    try:
        got = shm_files.fill(f, header, tensors.values(), alg)
    finally:
        f.release()
    assert got == ref
    assert (tmp_path / "shm").read_bytes() == (tmp_path / "ref").read_bytes()


def test_tensors_that_do_not_fill_the_file_are_refused(tmp_path):
    t = torch.randn(4)
    header = safetensors_io.build_header([to_blob("t", t)])
    f = shm_files.create(tmp_path / "f", len(header) + 4 * 4 + 8)
    try:
        with pytest.raises(ValueError, match="bytes written into a file"):
            shm_files.fill(f, header, [t], XXH3)
    finally:
        f.release()


def test_a_full_shared_memory_fails_the_snapshot_with_no_file_left(tmp_path, monkeypatch):
    """posix_fallocate says ENOSPC before anything is mapped (a store into a page tmpfs cannot
    give would be a SIGBUS)."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as e:
        shm_files.create(tmp_path / "f", 1 << 20)
    assert e.value.errno == errno.ENOSPC and list(tmp_path.iterdir()) == []


def test_each_snapshot_reuses_the_files_of_the_one_before_the_last_and_is_its_boundary(
        tmp_path, shm):
    """Snapshots every step: each holds its own step's state, bitwise, and verifies; once the
    live state took its files (from the spares, at the third boundary: live.py), each is
    written into the files of the one two steps before (same inodes), and none is made new."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    inodes, states = {}, {}
    for step in range(1, 9):
        _step(m, opt)
        states[step] = (copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()))
        ckpt.maybe_save(step)
        ckpt._memory.wait()
        [(newest, snap)] = list_checkpoints(shm)
        assert newest == step
        assert verify(snap, Level.FULL, None).ok
        model_sd, opt_sd = states[step]
        saved = load_file(snap / "model.safetensors")
        assert saved.keys() == model_sd.keys()
        assert all(torch.equal(saved[k], v) for k, v in model_sd.items())
        saved_opt = load_file(snap / "optimizer.safetensors")
        moments = [v for k, v in saved_opt.items() if k.endswith("exp_avg_sq")]
        want = [s["exp_avg_sq"] for s in opt_sd["state"].values()]
        assert sorted(t.sum().item() for t in moments) == sorted(t.sum().item() for t in want)
        inodes[step] = _inodes(snap)
        if step == 5:
            created = ckpt._memory._files.created
        if step >= 6:
            assert inodes[step] == inodes[step - 2], step  # the same files, written again
            assert ckpt._memory._files.created == created
        # The dir holds the newest snapshot and the spare files of the one before it.
        spares = [p for p in shm.iterdir() if p.name.startswith(TRASH_PREFIX)]
        if step < 3 or step >= 5:
            assert len(spares) == (0 if step == 1 else 1), step
    ckpt.close()
    assert [p.name for p in shm.iterdir() if p.name.startswith(".")] == []
    assert _maps_of(shm) == []


def test_a_restore_from_a_snapshot_in_reused_files_is_bitwise(tmp_path, shm):
    """rtrain persists the newest snapshot (written into reused files) and a new process
    restores it: the model and optimizer are exactly the boundary's."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    _train(ckpt, m, opt, range(1, 6))
    ckpt.close()
    tier = MemoryTierDir(tmp_path / "ckpts", None, lambda *a, **k: None, lambda s: None,
                         path=shm)
    assert tier.commit_newest(None, "attempt ended") == 5
    m2, opt2 = _model()
    assert rtrain.Checkpointer(model=m2, optimizer=opt2, ckpt_dir=tmp_path / "ckpts"
                               ).restore() == 5
    for a, b in zip(m.state_dict().values(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][name], s2[k][name])


def test_a_file_rtrain_pinned_is_never_written_again(tmp_path, shm):
    """rtrain pins the snapshot it persists with hard links and copies it while training
    goes on: the worker leaves those files alone (new ones take their place), so the pinned
    copy stays that step's, and persists whole."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    _train(ckpt, m, opt, range(1, 4))
    ckpt._memory.wait()
    [(_, snap)] = list_checkpoints(shm)
    v = verify(snap, Level.QUICK, None)
    pin = shm / ".pin-test"
    persist.link_files(snap, pin)  # what persist's _pin does
    before = {f.name: f.read_bytes() for f in pin.iterdir()}
    pinned_inodes = _inodes(snap)
    for step in range(4, 8):
        _step(m, opt)
        ckpt.maybe_save(step)
        ckpt._memory.wait()
        assert not set(_inodes(list_checkpoints(shm)[0][1]).values()) & set(
            pinned_inodes.values())
    assert {f.name: f.read_bytes() for f in pin.iterdir()} == before
    done = persist._commit(dict.fromkeys(v.manifest["files"], pin), v.manifest, None, pin,
                           v.step, tmp_path / "ckpts", False, 0o600)
    assert verify(done.path, Level.FULL, None).ok
    ckpt.close()


def test_a_snapshot_in_a_reused_file_changed_after_its_commit_is_refused(tmp_path, shm):
    """The hash is of the bytes written, taken before the commit: a byte changed afterwards
    in a reused file (the fourth snapshot's files are the second's) fails the persist."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    _train(ckpt, m, opt, range(1, 5))
    ckpt.close()
    [(_, snap)] = list_checkpoints(shm)
    f = snap / "optimizer.safetensors"
    with open(f, "r+b") as fh:
        fh.seek(-5, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-5, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0x01]))
    assert not verify(snap, Level.FULL, None).ok
    seen: list = []
    tier = MemoryTierDir(tmp_path / "ckpts", None, lambda k, **f: seen.append(k),
                         lambda s: None, path=shm)
    assert tier.commit_newest(None, "attempt ended") is None
    assert seen == ["snapshot_refused"]
    assert list_checkpoints(tmp_path / "ckpts") == []


def test_an_earlier_attempts_leftovers_go_with_the_first_snapshot(tmp_path, shm, make_ckpt):
    """A SIGKILLed attempt leaves its spare files (a trash-named dir) and maybe a temp dir
    half written: gone at the next attempt's first snapshot, not kept for the run's life."""
    spare = shm / f"{TRASH_PREFIX}7-0badcafe"
    spare.mkdir()
    (spare / "model.safetensors").write_bytes(b"x" * 4096)
    dead = shm / tmp_name(9).replace(f"-{os.getpid()}-", "-999999999-")
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"y" * 4096)
    pin = shm / ".pin-checkpoint-7-1-abcd"  # rtrain's: not the worker's to remove
    pin.mkdir()
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    _step(m, opt)
    ckpt.maybe_save(1)
    ckpt.close()
    assert not spare.exists() and not dead.exists() and pin.exists()
    assert [s for s, _ in list_checkpoints(shm)] == [1]


def test_a_drop_unmaps_the_files_at_the_next_step_boundary(tmp_path, shm):
    """rtrain drops the tier under memory pressure and removes the snapshots; pages a process
    still maps are not freed, so the worker unmaps its files and removes its spares at the next
    maybe_save, not at the next snapshot (which a long interval puts far away)."""
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=rtrain.Memory(every=50)))
    for step in (50, 100):
        _step(m, opt)
        ckpt.maybe_save(step)
    ckpt._memory.wait()
    assert _maps_of(shm)
    shmdir.drop(shm)
    _step(m, opt)
    ckpt.maybe_save(101)  # no snapshot due
    assert _maps_of(shm) == [] and ckpt._memory.off is not None
    assert [p.name for p in shm.iterdir() if p.name.startswith(".")] == []
    ckpt.close()


def test_a_state_whose_files_change_size_gets_new_files_and_leaves_no_spare(tmp_path, shm):
    """Before the optimizer's first step its state is empty: the first snapshots' optimizer
    files are small, the later ones large; a spare of the wrong size is deleted, not kept."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    ckpt.maybe_save(0)  # no optimizer state yet
    ckpt.maybe_save(1)
    for step in range(2, 6):
        _step(m, opt)
        ckpt.maybe_save(step)
        ckpt._memory.wait()
        [(_, snap)] = list_checkpoints(shm)
        assert verify(snap, Level.FULL, None).ok
    spares = [p for p in shm.iterdir() if p.name.startswith(TRASH_PREFIX)]
    assert len(spares) == 1 and sorted(f.name for f in spares[0].iterdir()) == [
        "extra.safetensors", "model.safetensors", "optimizer.safetensors"]
    maps = _maps_of(shm)
    # The newest snapshot's 3 files and the spare's 3; the live state's 2 (worker/memtier/live.py)
    assert len([ln for ln in maps if "/live/" not in ln]) == 6
    assert len([ln for ln in maps if "/live/" in ln]) == 2
    ckpt.close()


def test_a_restore_in_the_process_stops_the_reuse_of_what_it_maps(tmp_path, shm):
    """A restore may map a snapshot's file copy-on-write as the model's memory: the tier
    unmaps every file it wrote before that, and a file the process still maps privately is
    never written again (deleted, not kept as a spare: its bytes stay what the tensors viewing
    it hold); the snapshot's other files are reused, and every snapshot verifies."""
    m, opt = _model()
    ckpt = _tier_ckpt(m, opt, tmp_path)
    _train(ckpt, m, opt, range(1, 4))
    ckpt._memory.wait()
    ckpt.restore()
    assert _maps_of(shm) == []
    [(_, restored)] = list_checkpoints(shm)
    held = restored / "model.safetensors"
    with open(held, "rb") as f:  # as the restore's view of a parameter would stay mapped
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    before, held_ino = bytes(view), os.stat(held).st_ino
    _step(m, opt)
    ckpt.maybe_save(4)
    ckpt._memory.wait()
    spares = {e.inode() for p in shm.iterdir() if p.name.startswith(TRASH_PREFIX)
              for e in os.scandir(p)}
    assert spares and held_ino not in spares  # the others kept for reuse
    for step in range(5, 7):
        _step(m, opt)
        ckpt.maybe_save(step)
        ckpt._memory.wait()
        [(_, snap)] = list_checkpoints(shm)
        assert verify(snap, Level.FULL, None).ok
        assert os.stat(snap / "model.safetensors").st_ino != held_ino
    assert bytes(view) == before
    view.close()
    ckpt.close()
