"""An attempt's sealed live state committed to the checkpoint dir while the relaunch starts
(supervisor/memtier/background_commit.py): the pick and the progress rule count it as in the
dir before its copy is done, the copy verifies in full once done, and anything that commits or
picks a rollback waits for it. Others are committed before the relaunch, as before."""

from __future__ import annotations

import threading

import pytest
import torch

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.config import load_config
from rtrain.supervisor.decide.policy import History, ResumeMode
from rtrain.supervisor.launch.resume import Checkpoints
from rtrain.supervisor.memtier import persist
from rtrain.supervisor.memtier.tier import MemoryTierDir
from rtrain.supervisor.records.events import EventLog


def _live_state(tmp_path, steps: int = 6):
    """A Checkpointer whose state went live (Saving(memory=1000): no snapshot of its own), at
    step `steps`; its files are large enough to be hashed through a mapping as it is sealed."""
    torch.manual_seed(0)
    m = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ck = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "own", every=None,
                             saving=rtrain.Saving(memory=1000))
    for step in range(1, steps + 1):
        m(torch.randn(8, 512)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ck.maybe_save(step)
    return ck


@pytest.fixture
def held(monkeypatch):
    """persist.persist waits for `release` before copying: the copy stays in flight."""
    release, real = threading.Event(), persist.persist

    def slow(*a, **kw):
        release.wait(20)
        return real(*a, **kw)

    monkeypatch.setattr(persist, "persist", slow)
    return release


def _checkpoints(tmp_path, ckpts, said):
    cfg = load_config({"run_dir": tmp_path / "run"}, None, tmp_path)
    return Checkpoints(ckpts, cfg, None, EventLog(tmp_path / "run" / "events.jsonl"), said.append)


def test_the_sealed_state_is_picked_before_its_copy_is_done(tmp_path, shm, held, make_ckpt):
    ckpts = tmp_path / "ckpts"
    make_ckpt(ckpts, 2)  # an older disk save
    ck = _live_state(tmp_path)
    seen, said = [], []
    tier = MemoryTierDir(ckpts, None, lambda kind, **f: seen.append((kind, f)), said.append,
                         path=shm)
    checkpoints = _checkpoints(tmp_path, ckpts, said)
    checkpoints.in_flight = tier
    assert tier.commit_newest(2, "attempt ended", durable_later=True, background=True) == 6
    assert [k for k, _ in seen] == ["snapshot_sealed"]  # the copy is still running
    assert [s for s, _ in list_checkpoints(ckpts)] == [2]
    # The progress rule and the pick count it, without reading the dir for it.
    assert checkpoints.newest_step() == 6
    assert checkpoints.committed_since(0.0, None)
    sel = checkpoints.pick(History(), ResumeMode.LATEST, first=False)
    assert sel is not None and sel.chosen is not None
    assert sel.chosen.step == 6 and sel.chosen.path == ckpts / "checkpoint-6"
    assert tier.resume_path(sel.chosen) == shm / "checkpoint-6"  # read from memory
    held.set()
    tier.settle_sync()  # the next commit, a prune or the launch's end
    assert [k for k, _ in seen] == ["snapshot_sealed", "snapshot_persisted"]
    assert seen[1][1]["step"] == 6 and seen[1][1]["why"] == "attempt ended"
    assert verify(ckpts / "checkpoint-6", Level.FULL, None).ok
    assert tier.committing() is None and checkpoints.newest_step() == 6
    ck.close()


def test_a_rollback_waits_for_the_copy_and_skips_it(tmp_path, shm, held, make_ckpt):
    ckpts = tmp_path / "ckpts"
    make_ckpt(ckpts, 2)
    ck = _live_state(tmp_path)
    tier = MemoryTierDir(ckpts, None, lambda *a, **k: None, lambda s: None, path=shm)
    checkpoints = _checkpoints(tmp_path, ckpts, [])
    checkpoints.in_flight = tier
    tier.commit_newest(2, "attempt ended", background=True)
    threading.Timer(0.3, held.set).start()
    sel = checkpoints.pick(History(), ResumeMode.ROLLBACK, first=False)
    assert tier.committing() is None  # waited for: the rollback reads the dir as it is
    assert sel is not None and sel.chosen is not None and sel.chosen.step == 2
    ck.close()


def test_a_copy_that_fails_leaves_the_dirs_newest_and_says_so(tmp_path, shm, monkeypatch,
                                                              make_ckpt):
    ckpts = tmp_path / "ckpts"
    make_ckpt(ckpts, 2)
    ck = _live_state(tmp_path)

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(persist, "persist", full)
    said: list[str] = []
    tier = MemoryTierDir(ckpts, None, lambda *a, **k: None, said.append, path=shm)
    checkpoints = _checkpoints(tmp_path, ckpts, said)
    checkpoints.in_flight = tier
    tier.commit_newest(2, "attempt ended", background=True)
    tier._pending.wait()
    assert tier.committing() is None and checkpoints.newest_step() == 2
    tier.poll()  # the loop's next look
    assert any("No space left on device" in s and "stays in memory" in s for s in said), said
    assert [s for s, _ in list_checkpoints(shm)] == [6]  # the snapshot is kept
    ck.close()


def _worker_snapshot(tmp_path, shm):
    """A snapshot the worker wrote itself (Saving(memory=1)), of step 1; its path."""
    torch.manual_seed(0)
    m = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ck = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "own", every=None,
                             saving=rtrain.Saving(memory=1))
    m(torch.randn(2, 512)).sum().backward()
    opt.step()
    ck.maybe_save(1)
    ck._memory.wait()
    ck.close()
    ((_, path),) = list_checkpoints(shm)
    return path


def test_a_snapshot_the_worker_wrote_is_hashed_in_place_then_copied_beside_the_relaunch(
        tmp_path, shm, held):
    """The relaunch reads a snapshot unhashed: one rtrain did not seal is hashed here first."""
    _worker_snapshot(tmp_path, shm)
    ckpts = tmp_path / "ckpts"
    seen: list = []
    tier = MemoryTierDir(ckpts, None, lambda kind, **f: seen.append(kind), lambda s: None,
                         path=shm)
    assert tier.commit_newest(None, "attempt ended", background=True) == 1
    assert tier.committing() is not None and seen == []
    held.set()
    tier.settle_sync()
    assert seen == ["snapshot_persisted"]
    assert verify(ckpts / "checkpoint-1", Level.FULL, None).ok


def test_a_damaged_snapshot_is_refused_before_the_relaunch(tmp_path, shm):
    snap = _worker_snapshot(tmp_path, shm)
    f = snap / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    ckpts = tmp_path / "ckpts"
    seen: list = []
    said: list = []
    tier = MemoryTierDir(ckpts, None, lambda kind, **f: seen.append(kind), said.append,
                         path=shm)
    assert tier.commit_newest(None, "attempt ended", background=True) is None
    assert tier.committing() is None and seen == ["snapshot_refused"]
    assert "model.safetensors does not match its manifest (content hash)" in said[0]
    assert list_checkpoints(shm) == []
