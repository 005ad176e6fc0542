"""The disk cadence under the memory tier: a scheduled disk save is a snapshot that rtrain is
asked to persist (the worker's side), the request bookkeeping (one copy at a time, the newest
request waiting), and rtrain's copy with retention and a full disk (supervisor/memtier/
diskcadence.py). The launch with real processes is tests/test_memory_tier_launch.py."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

import rtrain
from rtrain.checkpoint.layout import list_checkpoints
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.core.protocol import ENV_HEARTBEAT
from rtrain.supervisor.memtier import decide
from rtrain.supervisor.memtier.diskcadence import DiskCadence
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.supervisor.retention.decide import RetentionPolicy
from rtrain.worker.memtier import handoff

KEEP_1 = {"keep": 1, "keep_best": 0, "metric": None, "mode": "min", "milestone_every": 0}


def _req(step):
    return decide.Request(step)


def test_one_copy_at_a_time_and_only_the_newest_request_waits():
    q, start = decide.requested(decide.Queue(), _req(4))
    assert start == _req(4) and q.running == 4
    q, start = decide.requested(q, _req(8))
    assert start is None and q.pending == _req(8)
    q, start = decide.requested(q, _req(12))  # replaces 8: its snapshot is gone by now
    assert start is None and q.pending == _req(12)
    q, start = decide.requested(q, _req(4))  # covered by the copy running (newest at 4 or later)
    q, start2 = decide.requested(q, _req(10))  # older than the one waiting
    assert start is None and start2 is None and q.pending == _req(12)
    q, nxt = decide.finished(q, 8)  # the copy took the newest snapshot then, step 8
    assert nxt == _req(12) and q == decide.Queue(running=12)
    q, nxt = decide.finished(q, None)  # nothing was committed: nothing waits
    assert nxt is None and q == decide.Queue()


def test_a_commit_that_covers_the_waiting_request_ends_the_queue():
    q, _ = decide.requested(decide.Queue(), _req(4))
    q, _ = decide.requested(q, _req(8))
    q, nxt = decide.finished(q, 9)  # the copy of request 4 found step 9 already
    assert nxt is None and q == decide.Queue()


@pytest.mark.parametrize("fields, expected", [
    (KEEP_1, RetentionPolicy(keep=1)),
    ({**KEEP_1, "keep": None, "milestone_every": 10},
     RetentionPolicy(keep=None, milestone_every=10)),
    ({**KEEP_1, "newer_field": 1}, RetentionPolicy(keep=1)),  # a newer worker's extra
    ({**KEEP_1, "keep": 0}, None),  # no valid rule: nothing is pruned
    ({**KEEP_1, "keep": "three"}, None),
    ({**KEEP_1, "keep_best": 2}, None),  # best without a metric
    ("keep 3", None),
    (None, None),
])
def test_the_workers_keep_policy_is_read_or_nothing_is_pruned(fields, expected):
    assert decide.policy_of(fields) == expected


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 1))
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _train(m, opt, ckpt, steps, start=0):
    paths = []
    for step in range(start, start + steps):
        loss = m(torch.randn(16, 32)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        paths.append(ckpt.maybe_save(step + 1))
    return paths


def _persist_heartbeats(receiver, n, timeout=5.0):
    got, deadline = [], time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [hb for hb in receiver.drain() if hb.event == "persist"]
        time.sleep(0.02)
    return got


def test_a_scheduled_disk_save_under_the_tier_is_a_snapshot_rtrain_is_asked_to_persist(
        tmp_path, shm, monkeypatch):
    """every=2 with the memory tier: the worker writes nothing to the checkpoint dir on
    schedule; each due step is snapshotted, recording the Keep policy in its manifest, and a
    `persist` heartbeat (a request: no policy) is sent once the snapshot committed. An
    explicit save() and request_save() stay disk writes."""
    ck = tmp_path / "ck"
    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv(ENV_HEARTBEAT, receiver.name)
        m, opt = _model()
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=ck, every=2, keep=2,
                                   saving=rtrain.Saving(memory=100))
        paths = _train(m, opt, ckpt, 4)
        ckpt._memory.wait()
        assert paths == [None, ck / "checkpoint-2", None, ck / "checkpoint-4"]
        assert list_checkpoints(ck) == []  # rtrain writes those
        assert [s for s, _ in list_checkpoints(shm)] == [4]
        got = _persist_heartbeats(receiver, 2)
        assert [hb.step for hb in got] == [2, 4]
        assert not hasattr(got[0], "persist")  # the request carries no policy
        [(_, snap)] = list_checkpoints(shm)
        manifest = verify(snap, Level.QUICK, None).manifest
        assert decide.snapshot_policy(manifest) == RetentionPolicy(keep=2)
        assert ckpt._clock.last_step == 4  # the schedule counts it as saved: next due at 6
        assert _train(m, opt, ckpt, 1, start=4) == [None]
        assert ckpt.save(5) == ck / "checkpoint-5"  # explicit: durable before it returns
        ckpt.request_save()
        assert _train(m, opt, ckpt, 1, start=5) == [ck / "checkpoint-6"]
        ckpt.close()
        assert _persist_heartbeats(receiver, 1, timeout=0.3) == []
    assert [s for s, _ in list_checkpoints(ck)] == [6, 5]


R = handoff.Route


@pytest.mark.parametrize("due, stop, requested, tier_takes, expected", [
    (False, False, False, True, R.NONE),
    (True, False, False, True, R.RTRAIN),  # on schedule, the tier on (named or by default)
    (True, False, False, False, R.DISK),  # no tier, the tier off, or a process group
    (True, False, True, True, R.DISK),  # request_save(), or a hand-off that failed
    (True, True, False, True, R.DISK),  # a stop: durable before the process exits
    (False, True, False, True, R.DISK),
    (False, True, False, False, R.DISK),
])
def test_only_a_scheduled_save_under_a_working_tier_goes_to_rtrain(due, stop, requested,
                                                                   tier_takes, expected):
    assert handoff.route(due=due, stop=stop, requested=requested,
                         tier_takes=tier_takes) is expected


def test_a_handed_saves_cost_for_the_cadence_counts_rtrains_copy_of_the_one_before():
    assert handoff.cadence_cost(0.02, None) == 0.02  # no copy seen yet: the stall alone
    assert handoff.cadence_cost(0.02, 0.5) == pytest.approx(0.52)
    w = handoff.CopyWatch()
    w.committed(5.0)  # nothing handed: nothing measured
    assert w.copy_s is None
    w.handed(4, 10.0)
    w.handed(6, 11.0)  # 4 merged into 6 (never seen): timed from 6's hand-off
    w.committed(11.7)
    assert w.step is None and w.copy_s == pytest.approx(0.7)
    w.handed(8, 12.0)  # not seen yet: the last measure stays
    assert w.copy_s == pytest.approx(0.7) and w.step == 8


def test_the_automatic_cadence_counts_how_long_rtrain_took_to_copy_the_last_hand_off(
        tmp_path, shm, monkeypatch):
    """every="auto" with `memory=` left out: once rtrain's copy of a hand-off shows in the
    checkpoint dir (made here, 0.4 s after the hand-off, as a slow copy would), the next
    interval is chosen from the stall plus that copy's time, not the stall alone."""
    ck = tmp_path / "ck"
    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv(ENV_HEARTBEAT, receiver.name)
        m, opt = _model()
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=ck,
                                   every=rtrain.Every(steps="auto", max_steps=2))
        beats, step = [], 0
        while not any(hb.event == "persist" for hb in beats) and step < 10:
            _train(m, opt, ckpt, 1, start=step)
            step += 1
            ckpt._memory.wait()
            beats += receiver.drain()
        [first] = [hb.step for hb in beats if hb.event == "persist"]
        time.sleep(0.4)
        (ck / f"checkpoint-{first}").mkdir(parents=True)  # rtrain's copy, committed
        before = len([hb for hb in beats if hb.event == "cadence"])
        while len([hb for hb in beats if hb.event == "cadence"]) == before and step < 20:
            _train(m, opt, ckpt, 1, start=step)
            step += 1
            beats += receiver.drain()
        ckpt.close()
    cadences = [hb.cadence for hb in beats if hb.event == "cadence"]
    assert len(cadences) > before, beats
    assert ckpt._copied.copy_s >= 0.4
    assert cadences[-1]["save_stall_s"] >= 0.4  # the copy's time, counted
    assert all(c["save_stall_s"] < 0.4 for c in cadences[:before])


def test_with_memory_left_out_a_scheduled_save_is_handed_to_rtrain_too(tmp_path, shm,
                                                                      monkeypatch):
    """The tier on by default (`memory=` left out, under rtrain launch) takes the scheduled
    disk saves as the named one does: a snapshot of the step, bitwise the state a save of it
    writes though the next optimizer step changes the live tensors, and a `persist` request.
    save() stays a disk write, durable before it returns."""
    ck = tmp_path / "ck"
    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv(ENV_HEARTBEAT, receiver.name)
        m, opt = _model()
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=ck, every=3)
        assert ckpt._memory is not None and ckpt._memory.implicit
        paths = _train(m, opt, ckpt, 3)
        assert paths == [None, None, ck / "checkpoint-3"]
        at3 = {k: v.clone() for k, v in m.state_dict().items()}
        _train(m, opt, ckpt, 1, start=3)  # the optimizer's step waits for the copy, then moves
        ckpt._memory.wait()
        assert list_checkpoints(ck) == []  # rtrain writes it
        assert [hb.step for hb in _persist_heartbeats(receiver, 1)] == [3]
        snap = dict(list_checkpoints(shm))[3]
        assert verify(snap, Level.FULL, None).ok
        held = load_file(snap / "model.safetensors")
        assert held.keys() == at3.keys() and all(torch.equal(held[k], at3[k]) for k in at3)
        assert not all(torch.equal(held[k], m.state_dict()[k]) for k in at3)
        assert ckpt.save(4) == ck / "checkpoint-4"
        ckpt.close()
    assert [s for s, _ in list_checkpoints(ck)] == [4]


def test_without_a_working_tier_the_scheduled_save_goes_to_disk(tmp_path, shm):
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck", every=2,
                               saving=rtrain.Saving(memory=rtrain.Memory(every=1,
                                                                          budget_mb=0.01)))
    _train(m, opt, ckpt, 2)  # the state does not fit the budget: the tier turns off
    ckpt.close()
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [2]


def _snapshots(tmp_path, shm, disk_steps, snap_at, keep=KEEP_1):
    """Checkpoints of `disk_steps` written by the worker itself (keeping all), then a
    snapshot at `snap_at` in shared memory whose manifest records the Keep policy `keep`; the
    checkpoint dir carries the run identity the snapshot names."""
    ck = tmp_path / "ck"
    m, opt = _model()
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=ck, keep=None,
                               saving=rtrain.Saving(memory=snap_at))
    ckpt._memory.keep = keep
    for step in range(1, snap_at + 1):
        _train(m, opt, ckpt, 1, start=step - 1)
        if step in disk_steps:
            ckpt._memory.wait()  # the snapshot of this step, if any, commits first
            ckpt.save(step)
    ckpt.close()
    assert [s for s, _ in list_checkpoints(shm)] == [snap_at]
    return ck


def _disk(shm, ckpts, seen, said, resumed=None):
    d = DiskCadence(shm, ckpts, None, file_mode=0o600,
                    emit=lambda kind, **f: seen.append((kind, f)), say=said.append)
    d.attempt_starting(3, resumed)
    return d


def test_rtrain_persists_the_snapshot_and_prunes_with_the_workers_policy(tmp_path, shm):
    ck = _snapshots(tmp_path, shm, disk_steps={1, 2, 3}, snap_at=6)
    seen, said = [], []
    d = _disk(shm, ck, seen, said, resumed=1)
    d.request(6)
    d.settle()
    [(kind, f)] = seen
    assert kind == "snapshot_persisted" and f["why"] == "disk cadence" and f["step"] == 6
    assert f["attempt"] == 3 and f["bytes"] > 0
    # keep=1: the newest (just committed) and the attempt's own checkpoint stay
    assert [s for s, _ in list_checkpoints(ck)] == [6, 1]
    v = verify(ck / "checkpoint-6", Level.FULL, None)
    assert v.ok and v.manifest["info"]["memory_snapshot"] is True
    d.request(4)  # an older request: the disk has its step's successor already
    d.settle()
    assert len(seen) == 1 and said == []


def test_a_full_disk_is_said_once_and_the_next_request_tries_again(tmp_path, shm,
                                                                    small_tmpfs):
    disk = small_tmpfs("1m")
    ck = disk / "ck"
    src = _snapshots(tmp_path, shm, disk_steps={1}, snap_at=2)
    shutil.copytree(src, ck)
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:  # the disk fills up for real
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    seen, said = [], []
    d = _disk(shm, ck, seen, said)
    d.request(2)
    d.settle()
    d.request(2)
    d.settle()
    assert [k for k, _ in seen] == ["snapshot_not_persisted"]  # once, not per request
    assert seen[0][1]["step"] == 2 and "No space left" in seen[0][1]["reason"]
    assert len(said) == 1 and "stays in memory" in said[0]
    assert [s for s, _ in list_checkpoints(shm)] == [2]  # nothing lost from memory
    assert not [p for p in ck.iterdir() if p.name.startswith(".")]  # no half copy left
    os.unlink(filler)
    d.request(2)
    d.settle()
    assert [k for k, _ in seen] == ["snapshot_not_persisted", "snapshot_persisted"]
    assert [s for s, _ in list_checkpoints(ck)] == [2]  # keep=1 pruned step 1


def test_a_step_saved_again_replaces_its_earlier_save_not_a_later_one(tmp_path, shm):
    """The worker's own save of step 6, made after the snapshot, stays; a replay of step 6
    (other values, snapshotted later) replaces it, as the worker's own save would."""
    ck = _snapshots(tmp_path, shm, disk_steps={6}, snap_at=6)
    own = (ck / "checkpoint-6" / "manifest.json").read_bytes()
    seen, said = [], []
    d = _disk(shm, ck, seen, said)
    d.request(6)
    d.settle()
    assert seen == [] and (ck / "checkpoint-6" / "manifest.json").read_bytes() == own
    m, opt = _model()
    with torch.no_grad():
        m[0].weight.add_(1.0)  # the replay took another path (a lower learning rate, say)
    ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "replay",
                               saving=rtrain.Saving(memory=6))
    _train(m, opt, ckpt, 6)
    ckpt.close()
    [(_, snap)] = list_checkpoints(shm)
    d.request(6)
    d.settle()
    assert [k for k, _ in seen] == ["snapshot_persisted"]
    assert (ck / "checkpoint-6" / "manifest.json").read_bytes() == \
        (snap / "manifest.json").read_bytes()
    assert verify(ck / "checkpoint-6", Level.FULL, None).ok


def test_the_automatic_cadence_goes_on_choosing_from_what_the_hand_off_costs(tmp_path, shm,
                                                                               monkeypatch):
    """every="auto" under the memory tier: each hand-off is a save to the clock (it counts
    from it, and chooses the next interval from its stall, which is the snapshot's, not a
    disk write's), and the saves keep coming at the interval chosen."""
    with HeartbeatReceiver() as receiver:
        monkeypatch.setenv(ENV_HEARTBEAT, receiver.name)
        m, opt = _model()
        ckpt = rtrain.Checkpointer(model=m, optimizer=opt, ckpt_dir=tmp_path / "ck",
                                   every=rtrain.Every(steps="auto", max_steps=3),
                                   saving=rtrain.Saving(memory=100))
        beats = []
        for step in range(12):  # read as rtrain does, before the socket's queue fills
            _train(m, opt, ckpt, 1, start=step)
            beats += receiver.drain()
        ckpt.close()
        time.sleep(0.2)
        beats += receiver.drain()
    persists = [hb.step for hb in beats if hb.event == "persist"]
    cadences = [hb.cadence for hb in beats if hb.event == "cadence"]
    assert list_checkpoints(tmp_path / "ck") == []
    assert len(persists) >= 4 and all(b - a <= 3 for a, b in itertools.pairwise(persists))
    assert cadences and all(c["every_steps"] <= 3 for c in cadences)
    assert ckpt._clock.last_step == persists[-1]
    # What the loop paid at the hand-off: well under a second for this small state.
    assert all(0 <= c["save_stall_s"] < 1.0 for c in cadences)
