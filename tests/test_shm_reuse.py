"""The memory tier reuses an earlier attempt's files in shared memory instead of making new ones
(worker/memtier/shm_files.py `adopt`): only where writing into them is safe, and with every
snapshot still whole and bitwise the state it names."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from harness import child_env
from safetensors.torch import load_file

import rtrain
from rtrain.checkpoint.layout import TRASH_PREFIX, list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.worker.memtier import shm_files


def _file(path, size=1 << 16, fill=b"\x07"):
    path.write_bytes(fill * size)
    return os.stat(path).st_ino


def test_adopt_takes_only_files_safe_to_write(tmp_path):
    """An earlier attempt's committed snapshot: renamed out of the committed names, its
    tensor files kept as spares (the same inodes, mapped); a file this process maps (the
    restore's copy-on-write view), one linked twice (rtrain's pin) and a symlink are not
    written: their names go, as a deletion's would, and their bytes are untouched."""
    snap = tmp_path / "checkpoint-4"
    snap.mkdir()
    free = _file(snap / "model.safetensors")
    _file(snap / "optimizer.safetensors")
    _file(snap / "extra.safetensors")
    os.link(snap / "extra.safetensors", tmp_path / "pin")
    _file(tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", snap / "rng.safetensors")
    (snap / "manifest.json").write_text("{}")
    with open(snap / "optimizer.safetensors", "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # as the restore maps it
    files = shm_files.ShmFiles()
    try:
        files.adopt(snap)
        assert not snap.exists()  # never a committed name again
        [aside] = tmp_path.glob(f"{TRASH_PREFIX}*")
        assert os.listdir(aside) == ["model.safetensors"]
        assert files.spare_bytes == 1 << 16
        (tmp_path / "live").mkdir()
        taken = files.take_spare(tmp_path / "live" / "model.safetensors", 1 << 16)
        assert taken is not None and taken.ino == free
        assert not aside.exists()  # its last spare left it
        assert files.take_spare(tmp_path / "optimizer.safetensors", 1 << 16) is None
        assert view[:1] == b"\x07" and os.stat(tmp_path / "pin").st_nlink == 1
        assert (tmp_path / "elsewhere.safetensors").read_bytes()[:1] == b"\x07"
        taken.release()
    finally:
        view.close()
        files.close()


def test_a_spare_of_another_size_is_not_taken(tmp_path):
    snap = tmp_path / "checkpoint-2"
    snap.mkdir()
    _file(snap / "model.safetensors", 4096)
    files = shm_files.ShmFiles()
    files.adopt(snap)
    assert files.take_spare(tmp_path / "model.safetensors", 8192) is None
    assert files.spare_bytes == 0 and not list(tmp_path.glob(f"{TRASH_PREFIX}*"))
    files.close()


EARLIER = textwrap.dedent("""
    import os, signal, sys, torch, rtrain
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(m.parameters())
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=sys.argv[1],
                               saving=rtrain.Saving(memory=rtrain.Memory(every=1)))
    for step in range(8):
        loss = m(torch.randn(4, 256)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step(); ckpt.maybe_save(step + 1)
    ckpt._memory.wait()
    os.kill(os.getpid(), signal.SIGKILL)  # dies with its snapshot, spares and live state
""")


def _inodes(directory):
    return {e.name: e.inode() for e in os.scandir(directory) if e.name.endswith(".safetensors")}


@pytest.mark.slow
def test_a_relaunch_fills_the_earlier_attempts_files_not_new_ones(tmp_path, shm):
    """A process snapshots every step and is SIGKILLed: it leaves a committed snapshot, a
    retired one's spares and its live state's files. The next process writes its snapshots
    and its live state into those: no file made new for the three sets a snapshot every step
    keeps in use (committed, being written, live), and each snapshot verifies and holds its
    step bitwise."""
    done = subprocess.run([sys.executable, "-c", EARLIER, str(tmp_path / "ck")],
                          env=child_env(RTRAIN_MEMORY_DIR=str(shm)), capture_output=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    [(_, earlier)] = list_checkpoints(shm)
    [spares] = shm.glob(f"{TRASH_PREFIX}*")
    from_spares, from_earlier = _inodes(spares), _inodes(earlier)
    from_live = _inodes(shm / "live")  # marked, but no rtrain here to seal it
    assert {"model.safetensors", "optimizer.safetensors"} <= from_spares.keys()

    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(m.parameters())
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck2",
                               saving=rtrain.Saving(memory=rtrain.Memory(every=1)))
    tier = ckpt._memory
    for step in range(6):
        loss = m(torch.randn(4, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step + 1)
        tier.wait()
        if step == 0:
            [(_, first)] = list_checkpoints(shm)
            got = _inodes(first)
            assert all(got[n] == from_spares[n] for n in from_spares), (got, from_spares)
            assert tier._files.created == 0
            assert not earlier.exists()  # taken as spares once a newer one committed
    assert tier.live is not None and tier.live.adopted
    earlier_inodes = {*from_spares.values(), *from_earlier.values(), *from_live.values()}
    live = _inodes(shm / "live")
    assert {live["model.safetensors"], live["optimizer.safetensors"]} <= earlier_inodes
    # Three sets in use (committed, being written, live), the three the kill left here.
    assert tier._files.created == 0
    [(step, snap)] = list_checkpoints(shm)
    assert step == 6 and verify(snap, Level.FULL, None).ok
    saved = load_file(snap / "model.safetensors")
    for name, t in m.state_dict().items():
        assert torch.equal(saved[name], t), name
    ckpt.close()
