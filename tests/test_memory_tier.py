"""The memory tier's units: the pure rules, a snapshot that describes its step boundary while
training goes on, the budget, rtrain's drop, and the persisting copy's checks. The launch with
real kills is tests/test_memory_tier_launch.py."""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, MEMORY_DROPPED
from rtrain.supervisor.memtier import decide, persist, shmdir
from rtrain.supervisor.memtier.tier import MemoryTierDir
from rtrain.worker.memtier import memory_tier, pacing


@pytest.mark.parametrize("snap, disk, same_run, expected", [
    (None, 5, True, None),
    (7, None, True, 7),
    (7, 5, True, 7),
    (5, 5, True, None),  # the disk has it already
    (4, 5, True, None),  # older than the disk: adds nothing
    (7, 5, False, None),  # another run's (the dir started over)
])
def test_persist_only_a_newer_snapshot_of_this_run(snap, disk, same_run, expected):
    assert decide.worth_persisting(snap, disk, same_run=same_run) is (expected is not None)


@pytest.mark.parametrize("snap, chosen, same, expected", [
    (7, 7, True, True), (7, 5, True, False), (7, 7, False, False), (None, 7, True, False),
    (7, None, True, False),
])
def test_resume_from_memory_only_the_checkpoint_picked(snap, chosen, same, expected):
    assert decide.resume_from_memory(snap, chosen, same_files=same) is expected


@pytest.mark.parametrize("cost, write, step, mtbf, expected", [
    (0.001, 0.01, 0.1, None, 1),  # cheap and quick: every step
    (0.003, 0.01, 0.1, None, 1),  # exactly the ceiling: 3 % of a 100 ms step
    (0.01, 0.01, 0.1, None, 4),  # a 10 ms cost on a 100 ms step: every 4 (2.5 %)
    (0.018, 0.02, 0.11, None, 6),  # the MLP at the writer's full CPU time: 2.7 %
    (0.001, 0.35, 0.1, None, 4),  # the write takes 3.5 steps: every 4, never queued
    (0.003, 0.01, 0.1, 5.0, 1),  # failures every 5 s: Young/Daly (1.7) under the ceiling's
    (0.003, 0.01, 0.1, 6 * 3600.0, 113),  # every 6 h: Young/Daly's 11 s between snapshots
    (0.0, 0.0, 0.0, None, 1),  # nothing measured yet
])
def test_auto_interval(cost, write, step, mtbf, expected):
    assert pacing.interval(cost_s=cost, write_s=write, step_s=step, mtbf_s=mtbf) == expected


def test_the_ceiling_is_a_named_constant_that_bounds_the_cost():
    for cost in (0.0005, 0.002, 0.007, 0.05, 0.4):
        n = pacing.interval(cost_s=cost, write_s=0.0, step_s=0.1, mtbf_s=None)
        assert cost / (n * 0.1) <= pacing.COST_CEILING + 1e-12
        assert n == 1 or cost / ((n - 1) * 0.1) > pacing.COST_CEILING  # and no longer


def test_the_cost_is_the_steps_measured_difference_a_moving_median():
    c = pacing.Costs()
    assert c.cost_s() is None and c.step_s() is None
    for i in range(pacing.MIN_SAMPLES):
        c.step(0.100 + 0.001 * i, snapshot=False)
        assert c.cost_s() is None  # no step beside a snapshot yet
    for _ in range(pacing.MIN_SAMPLES - 1):
        c.step(0.105, snapshot=True)
    assert c.cost_s() is None
    c.step(0.5, snapshot=True)  # one step held up by something else: the median holds
    assert c.cost_s() == pytest.approx(0.105 - 0.1015)
    assert c.step_s() == pytest.approx(0.1015)
    for _ in range(pacing.WINDOW):  # the moving window forgets the first snapshots
        c.step(0.101, snapshot=True)
    assert c.cost_s() == pytest.approx(0.101 - 0.1015) or c.cost_s() == 0.0
    assert c.cost_s() == 0.0  # never negative


def test_held_steps_are_measured_as_neither_kind():
    c = pacing.Costs()
    c.hold(1)
    c.hold(2)  # the longer of two holds, not their sum
    c.step(0.5, snapshot=True)
    c.step(None, snapshot=False)  # an unmeasured step passes a held one all the same
    assert not c.beside and not c.clean
    c.step(0.1, snapshot=True)
    c.step(None, snapshot=False)
    assert list(c.beside) == [0.1] and not c.clean


def test_a_snapshot_that_made_its_files_new_is_not_counted_in_the_cost(tmp_path, shm,
                                                                        monkeypatch):
    """Making a file new costs the kernel every page once, paid by the steps beside that
    snapshot (here: 0.3 s, waited for within the step). The first two snapshots make new
    files; counted, they were half of the first MIN_SAMPLES steps beside a snapshot, and the
    first cost measured (the one the interval is chosen from, for REPACE_STEPS steps) read
    about 0.3 s. Left out, it reads what a snapshot into reused files adds: a few ms."""
    from rtrain.worker.memtier import shm_files

    create = shm_files.create

    def slow_create(*a, **kw):
        time.sleep(0.3)
        return create(*a, **kw)

    monkeypatch.setattr(shm_files, "create", slow_create)
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory="auto"))
    tier = ckpt._memory
    measured = []

    def step(_):
        tier.wait()  # the snapshot started at the last boundary, its new files included
        if tier.costs.cost_s() is not None:
            measured.append(tier.costs.cost_s())

    _train(m, opt, ckpt, 24, between=step)
    tier.wait()
    assert tier._files.created >= 6  # two sets before any spare could be reused
    assert measured, "the cost was never measured"
    assert measured[0] < 0.05, (measured[0], list(tier.costs.beside), list(tier.costs.clean))
    ckpt.close()


def test_the_estimate_spans_attempts_and_a_damaged_record_is_an_empty_one():
    c = pacing.Costs()
    for _ in range(pacing.MIN_SAMPLES):
        c.step(0.1, snapshot=False)
        c.step(0.102, snapshot=True)
    again = pacing.Costs.from_state(json.loads(json.dumps(c.state())))
    assert again.cost_s() == pytest.approx(0.002)
    for bad in (None, [], {"beside": "x"}, {"beside": [True, -1, 1e9, "1"], "clean": [0.1]}):
        got = pacing.Costs.from_state(bad)
        assert not got.beside and got.cost_s() is None


def test_refusal_says_what_to_change():
    assert memory_tier.refusal(1 << 20, 1 << 30, 1 << 30) is None
    assert "budget_mb" in memory_tier.refusal(1 << 30, 1 << 30, 4 << 30)
    assert "--shm-size" in memory_tier.refusal(1 << 30, 8 << 30, 1 << 30)


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                            torch.nn.Linear(64, 1))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m, opt, ckpt, steps, start=0, between=None):
    for step in range(start, start + steps):
        loss = m(torch.randn(16, 32)).pow(2).mean()
        if between is not None:
            between(step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.maybe_save(step + 1)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_snapshot_is_its_step_boundary_while_training_goes_on(tmp_path, shm, overlap,
                                                                 monkeypatch):
    """Snapshots every 3 steps; the state at step 3 is recorded at the boundary; the training
    changes the weights (optimizer) and the batch-norm statistics (forward) right after, while
    the snapshot's writes are slowed down. The snapshot must hold step 3's values, every byte:
    the optimizer's pre-hook held its step (here it never abandons the copy: the next test),
    the buffers were copied at the boundary."""
    from rtrain.checkpoint.commit import PendingCheckpoint
    from rtrain.worker.memtier import shm_files

    monkeypatch.setattr(memory_tier, "MAX_ABANDONED", 0)

    write, fill = PendingCheckpoint.write_tensors, shm_files.fill

    def slow(self, *a, **kw):
        time.sleep(0.2)
        return write(self, *a, **kw)

    def slow_fill(*a, **kw):  # a single process's files: written into mapped shared memory
        time.sleep(0.2)
        return fill(*a, **kw)

    monkeypatch.setattr(PendingCheckpoint, "write_tensors", slow)
    monkeypatch.setattr(shm_files, "fill", slow_fill)
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=rtrain.Memory(every=3,
                                                                          overlap=overlap)))
    _train(m, opt, ckpt, 3)
    at3 = copy.deepcopy(m.state_dict())
    opt3 = copy.deepcopy(opt.state_dict())
    _train(m, opt, ckpt, 2, start=3)  # the step-3 snapshot is written meanwhile
    ckpt._memory.wait()
    [(step, snap)] = list_checkpoints(shm)
    assert step == 3
    assert verify(snap, Level.FULL, None).ok
    saved = load_file(snap / "model.safetensors")
    for name, t in at3.items():
        assert torch.equal(saved[name], t), name
    assert not torch.equal(saved["0.weight"], m.state_dict()["0.weight"])  # it did move on
    saved_opt = load_file(snap / "optimizer.safetensors")
    exp_avg = [v for k, v in saved_opt.items() if k.endswith("exp_avg")]
    assert exp_avg and any(torch.equal(e, opt3["state"][0]["exp_avg"]) for e in exp_avg)
    ckpt.close()
    assert not list((tmp_path / "ck").glob("checkpoint-*"))  # the disk tier saw nothing


def test_double_buffering_keeps_only_the_newest_complete_snapshot(tmp_path, shm):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1))
    _train(m, opt, ckpt, 6)
    ckpt.close()
    assert [s for s, _ in list_checkpoints(shm)] == [6]
    assert [p.name for p in shm.iterdir() if p.name.startswith(".")] == []


def test_a_state_that_does_not_fit_twice_leaves_the_tier_off(tmp_path, shm, caplog):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=rtrain.Memory(every=1,
                                                                          budget_mb=0.01)))
    with caplog.at_level(logging.WARNING):
        _train(m, opt, ckpt, 3)
    ckpt.close()
    assert list_checkpoints(shm) == []
    assert "memory tier off" in caplog.text and "Memory(budget_mb=)" in caplog.text


def test_rtrain_dropping_the_tier_stops_snapshots(tmp_path, shm, caplog):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1))
    _train(m, opt, ckpt, 2)
    ckpt._memory.wait()
    assert shmdir.drop(shm) > 0
    with caplog.at_level(logging.WARNING):
        _train(m, opt, ckpt, 3, start=2)
    ckpt.close()
    assert list_checkpoints(shm) == [] and (shm / MEMORY_DROPPED).exists()
    assert "rtrain dropped it" in caplog.text


def test_outside_rtrain_the_tier_is_off_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(ENV_MEMORY_DIR, raising=False)
    m, opt = _model()
    with caplog.at_level(logging.WARNING):
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                                   saving=rtrain.Saving(memory="auto"))
    assert ckpt._memory is None and "rtrain launch" in caplog.text


@pytest.mark.parametrize("bad", [-1, "often", 1.5])
def test_bad_memory_values_fail_where_they_are_written(bad):
    with pytest.raises((ValueError, TypeError), match=r"(?i)memory"):
        rtrain.Saving(memory=bad)


def test_the_tier_is_on_unless_turned_off(tmp_path, shm):
    """Left out, `memory=` is the tier where it fits; None, 0 and False turn it off; a number
    is still every that many steps."""
    from rtrain.worker import options

    assert rtrain.Saving().memory is options.MEMORY_DEFAULT
    for off in (None, 0, False):
        assert rtrain.Saving(memory=off).memory is None
    assert rtrain.Saving(memory=3).memory == rtrain.Memory(every=3)
    m, opt = _model()
    on = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "a")
    assert on._memory is not None and on._memory.implicit
    off = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "b",
                              saving=rtrain.Saving(memory=0))
    assert off._memory is None
    named = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "c",
                                saving=rtrain.Saving(memory="auto"))
    assert named._memory is not None and not named._memory.implicit
    for c in (on, off, named):
        c.close()


def test_left_out_outside_rtrain_launch_the_tier_is_off_without_a_word(tmp_path, monkeypatch,
                                                                      caplog):
    monkeypatch.delenv(ENV_MEMORY_DIR, raising=False)
    m, opt = _model()
    with caplog.at_level(logging.INFO):
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck")
    assert ckpt._memory is None and "memory tier" not in caplog.text


def test_left_out_under_several_ranks_the_tier_stays_off(tmp_path, shm, monkeypatch):
    """torchrun's WORLD_SIZE before any process group: the ranks would share one memory dir."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck")
    assert ckpt._memory is None
    named = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "c2",
                                saving=rtrain.Saving(memory="auto"))
    assert named._memory is not None  # named: as before
    ckpt.close()
    named.close()


def test_a_copy_the_optimizer_step_overtakes_is_abandoned_never_committed(tmp_path, shm,
                                                                          monkeypatch):
    """Under "auto", the writer's copy is slowed so that the optimizer's next step comes
    first: that snapshot is abandoned (the step does not wait), nothing of it is committed,
    the newest committed snapshot stays the previous one, whole; after MAX_ABANDONED in a row
    the next one is waited for and holds its step bitwise. A fixed interval always waits (the
    test before)."""
    from rtrain.worker.memtier import shm_files

    fill = shm_files.fill

    def slow_fill(*a, **kw):
        time.sleep(0.15)
        return fill(*a, **kw)

    # "auto" at every step, as after earlier attempts measured a snapshot to cost nothing.
    monkeypatch.setattr(memory_tier, "_read_pace", lambda _: {"beside": [0.1] * 4,
                                                              "clean": [0.1] * 4})
    monkeypatch.setattr(memory_tier.pacing, "interval", lambda **_: 1)
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory="auto"))
    _train(m, opt, ckpt, 1)
    ckpt._memory.wait()
    assert [s for s, _ in list_checkpoints(shm)] == [1]  # the first, not slowed
    monkeypatch.setattr(shm_files, "fill", slow_fill)
    seen = []
    # Boundaries 2..MAX_ABANDONED+1 abandoned by the next step's optimizer; the one after is
    # waited for by its optimizer step; the last boundary's is left running.
    _train(m, opt, ckpt, memory_tier.MAX_ABANDONED + 2, start=1,
           between=lambda step: seen.append(sorted(s for s, _ in list_checkpoints(shm))))
    assert seen[:memory_tier.MAX_ABANDONED + 1] == [[1]] * (memory_tier.MAX_ABANDONED + 1)
    assert ckpt._memory.abandoned == memory_tier.MAX_ABANDONED
    assert ckpt._memory.gate_s > 0.05  # the snapshot after them was waited for
    ckpt._memory.wait()
    newest = memory_tier.MAX_ABANDONED + 3
    [(step, snap)] = list_checkpoints(shm)
    assert step == newest and verify(snap, Level.FULL, None).ok
    saved = load_file(snap / "model.safetensors")
    for name, t in m.state_dict().items():
        assert torch.equal(saved[name], t), name
    assert not [d for d in os.listdir(shm) if d.startswith(".tmp-")]  # nothing half-made
    ckpt.close()


def _snapshot(tmp_path, shm, steps=2):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1))
    _train(m, opt, ckpt, steps)
    ckpt.close()
    [(_, snap)] = list_checkpoints(shm)
    return snap


def test_an_earlier_attempts_newer_snapshot_goes_with_the_first_new_one(tmp_path, shm,
                                                                        make_ckpt):
    """After a rollback the snapshots of the steps beyond it are what failed: the first
    snapshot of the new attempt replaces them, however high their step."""
    make_ckpt(shm, 100)
    snap = _snapshot(tmp_path, shm)  # asserts that its own step 2 is the only one left
    assert snap.name == "checkpoint-2"


def _events(into):
    return lambda kind, **f: into.append((kind, f))


def test_persisting_copies_a_snapshot_that_verifies_like_any_checkpoint(tmp_path, shm):
    snap = _snapshot(tmp_path, shm)
    ckpts = tmp_path / "ckpts"
    seen: list = []
    tier = MemoryTierDir(ckpts, None, _events(seen), lambda s: None, path=shm)
    assert tier.commit_newest(None, "attempt ended") == 2
    v = verify(ckpts / "checkpoint-2", Level.FULL, None)
    assert v.ok and v.manifest["info"]["memory_snapshot"] is True
    assert [k for k, _ in seen] == ["snapshot_persisted"]
    assert seen[0][1]["why"] == "attempt ended" and seen[0][1]["bytes"] > 0
    assert tier.commit_newest(2, "attempt ended") is None  # the disk has it now
    assert tier.resume_path(v) == snap  # the relaunch reads it from memory
    assert [p.name for p in shm.iterdir() if p.name.startswith(".pin")] == []


def test_an_attempts_commit_is_made_durable_beside_the_relaunch(tmp_path, shm, monkeypatch):
    """At an attempt's end the copy commits without fsync (the relaunch waits for it) and a
    thread fsyncs it; the next commit, a disk-cadence request and the launch's end wait for
    that thread first."""
    _snapshot(tmp_path, shm)
    ckpts = tmp_path / "ckpts"
    synced, release = [], threading.Event()

    def slow_durable(path):
        release.wait(10)
        synced.append(path.name)

    monkeypatch.setattr(persist, "make_durable", slow_durable)
    tier = MemoryTierDir(ckpts, None, lambda *a, **k: None, lambda s: None, path=shm)
    assert tier.commit_newest(None, "attempt ended", durable_later=True) == 2
    assert verify(ckpts / "checkpoint-2", Level.FULL, None).ok  # committed, readable now
    assert synced == []  # its fsync still running
    release.set()
    tier.settle_sync()
    assert synced == ["checkpoint-2"]
    tier.close(2)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_snapshot_is_refused_and_the_disk_left_alone(tmp_path, shm, damage):
    snap = _snapshot(tmp_path, shm)
    f = snap / "model.safetensors"
    if damage == "flip":
        raw = bytearray(f.read_bytes())
        raw[-3] ^= 0xFF
        f.write_bytes(bytes(raw))
    elif damage == "truncate":
        os.truncate(f, f.stat().st_size - 10)
    else:
        m = json.loads((snap / "manifest.json").read_text())
        m["step"] = 99
        (snap / "manifest.json").write_text(json.dumps(m))
    ckpts = tmp_path / "ckpts"
    seen: list = []
    said: list = []
    tier = MemoryTierDir(ckpts, None, _events(seen), said.append, path=shm)
    assert tier.commit_newest(None, "attempt ended") is None
    assert [k for k, _ in seen] == ["snapshot_refused"]
    assert list_checkpoints(ckpts) == [] and list_checkpoints(shm) == []
    assert (list(ckpts.iterdir()) if ckpts.exists() else []) == []  # no temp dir left either
    assert "resuming from the disk tier" in said[0]


def test_a_signed_snapshot_from_another_key_is_refused(tmp_path, shm):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1), signing_key="someone else")
    _train(m, opt, ckpt, 2)
    ckpt.close()
    seen: list = []
    tier = MemoryTierDir(tmp_path / "ckpts", b"k" * 32, _events(seen), lambda s: None,
                         path=shm)
    assert tier.commit_newest(None, "attempt ended") is None
    assert [k for k, _ in seen] == ["snapshot_refused"]


def test_the_directory_is_owner_only_and_a_link_is_refused(tmp_path):
    d = tmp_path / "rtrain-x"
    shmdir.prepare(d, None)
    assert (d.stat().st_mode & 0o777) == 0o700
    link = tmp_path / "rtrain-link"
    link.symlink_to(d)
    with pytest.raises(shmdir.Unusable, match="not a directory of this user"):
        shmdir.prepare(link, None)


def test_a_snapshot_removed_while_pinned_is_refused_not_half_copied(tmp_path, shm):
    snap = _snapshot(tmp_path, shm)
    v = verify(snap, Level.QUICK, None)
    for f in snap.iterdir():
        f.unlink()
    snap.rmdir()
    with pytest.raises(persist.SnapshotRefused, match="removed"):
        persist.persist(v, tmp_path / "ckpts")


def test_auto_spaces_snapshots_so_none_waits_for_the_previous_write(tmp_path, shm, monkeypatch):
    """Under "auto", a write that takes several steps (slowed down here) spreads the snapshots
    out instead of making every step wait for the previous one."""
    from rtrain.checkpoint.commit import PendingCheckpoint

    write = PendingCheckpoint.write_bytes

    def slow(self, *a, **kw):
        time.sleep(0.5)  # state.json: after the copy, so the optimizer never waits for it
        return write(self, *a, **kw)

    monkeypatch.setattr(PendingCheckpoint, "write_bytes", slow)
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory="auto"))
    taken = []
    real = ckpt._memory.snapshot
    ckpt._memory.snapshot = lambda cap: (taken.append(cap.step), real(cap))
    _train(m, opt, ckpt, 30, between=lambda step: time.sleep(0.02))
    ckpt.close()
    # 0.5 s writes over steps of a few tens of ms (more on a loaded machine): spread out. The
    # first snapshot is taken before any write was measured, so steps 1, 2, then every other
    # one at most: 16 of the 30.
    assert ckpt._memory.every >= 2, ckpt._memory.every
    assert taken[0] == 1 and len(taken) <= 16, taken


def test_only_the_snapshot_rtrain_handed_over_is_read_unhashed(tmp_path, shm, monkeypatch):
    """RTRAIN_RESUME_FROM inside RTRAIN_MEMORY_DIR: read unhashed (the model's file mapped),
    the restore exact. The same snapshot named any other way (a path given to restore(), a
    copy elsewhere) is read hashed, so a byte changed in it is caught."""
    from rtrain.supervisor.core.errors import CorruptCheckpoint
    from rtrain.supervisor.core.protocol import ENV_RESUME_FROM
    from rtrain.worker.restoring.restore import handed_over_from_memory

    snap = _snapshot(tmp_path, shm, steps=3)
    monkeypatch.setenv(ENV_RESUME_FROM, str(snap))
    assert handed_over_from_memory(snap)
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=None))  # keeps `snap` to look at
    assert ckpt.restore() == 3
    saved = load_file(snap / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in m.state_dict().items() if k in saved)
    _train(m, opt, ckpt, 2, start=3)  # the optimizer writes its mapped state: copy-on-write
    assert torch.equal(load_file(snap / "model.safetensors")["0.weight"], saved["0.weight"])

    elsewhere = tmp_path / "copy" / snap.name
    import shutil
    shutil.copytree(snap, elsewhere)
    assert not handed_over_from_memory(elsewhere)
    f = elsewhere / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-3] ^= 0xFF
    f.write_bytes(bytes(raw))
    monkeypatch.delenv(ENV_RESUME_FROM)
    with pytest.raises(CorruptCheckpoint):
        rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck").restore(elsewhere)


def test_an_encrypted_snapshot_is_persisted_and_restored_under_its_key(tmp_path, shm,
                                                                        monkeypatch):
    """Encrypted as the run's disk checkpoints are: rtrain copies it byte for byte (the
    manifest's hashes are of the sealed bytes), and the relaunch handed it over decrypts and
    authenticates it (nothing read unhashed), exactly."""
    from rtrain.supervisor.core.protocol import ENV_RESUME_FROM

    key = "a passphrase for the memory tier"
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                               saving=rtrain.Saving(memory=1), encryption_key=key)
    _train(m, opt, ckpt, 3)
    ckpt.close()
    [(_, snap)] = list_checkpoints(shm)
    assert "encryption" in json.loads((snap / "manifest.json").read_text())
    ckpts = tmp_path / "ckpts"
    tier = MemoryTierDir(ckpts, None, _events([]), lambda s: None, path=shm)
    assert tier.commit_newest(None, "attempt ended") == 3
    assert verify(ckpts / "checkpoint-3", Level.FULL, None).ok
    monkeypatch.setenv(ENV_RESUME_FROM, str(snap))
    m2, opt2 = _model()
    assert rtrain.Checkpointer(model=m2, optimizer=opt2, ckpt_dir=ckpts,
                               encryption_key=key).restore() == 3
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                 m2.state_dict().values(), strict=True))


@pytest.mark.parametrize("measured, cpu, busy, expected", [
    (0.010, 0.015, 0.5, 0.010),   # measured, within both bounds
    (0.050, 0.015, 0.5, 0.015),   # noise above what the CPU time can take: the CPU time
    (0.000, 0.015, 1.0, 0.015),   # nothing measured on busy cores: all of the CPU time
    (0.000, 0.015, 0.25, 0.00375),  # idle cores took most of it
    (-0.01, None, 1.0, 0.0),      # no CPU time known yet: the measurement, never negative
    (0.000, 0.015, 3.0, 0.015),   # a share above 1 (several processes' threads) is 1
])
def test_a_snapshots_cost_is_bounded_by_its_cpu_time_both_ways(measured, cpu, busy, expected):
    assert pacing.bounded_cost(measured, cpu, busy) == pytest.approx(expected)
