"""A node's side of the memory tier's peer copies (supervisor/memtier/peerside.py): copying the
ring predecessor's newest parts and keeping its own beside them, a replacement node gathering
the newest whole step at its start, and what a bad peer costs (a tampered part, another run, a
peer that says nothing): refused with a reason, an older step or the disk tier, no hang. Real
servers on 127.0.0.1 and real parts, threads only; the pure decisions table tested."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
from conftest import PART_RUN, make_part
from conftest import PeerEvents as Events

from rtrain.checkpoint import parts
from rtrain.checkpoint.layout import checkpoint_name
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.memtier import decide, registry
from rtrain.supervisor.memtier.peerserver import PeerServer
from rtrain.supervisor.memtier.peerside import PeerSide, serving_address
from rtrain.worker.memtier import memory_resume

RUN = PART_RUN
OTHER = "2" * 32


def side(ck: Path, memory_dir: Path, ev: Events, **kw) -> PeerSide:
    memory_dir.mkdir(exist_ok=True)
    # A long interval: the tests call replicate_once themselves.
    p = PeerSide(memory_dir, ck, None, "127.0.0.1", ev.emit, ev.said.append,
                 interval_s=3600, timeout_s=kw.pop("timeout_s", 2.0), **kw)
    p.start(kw.pop("run", RUN))
    return p


def whole(memory_dir: Path) -> list[tuple[int, int]]:
    found = parts.list_parts(memory_dir, None)
    return parts.whole_steps([(p.rank, p.step, p.world_size, p.run) for p in found], RUN)


def test_a_node_copies_its_predecessors_newest_parts_and_keeps_its_own_beside_them(tmp_path, ck):
    ev = Events()
    ma, mb = tmp_path / "a", tmp_path / "b"
    for step in (4, 5):
        make_part(ma, 0, 2, step)
        make_part(mb, 1, 2, step)
    a, b = side(ck, ma, ev), side(ck, mb, Events())
    try:
        assert whole(ma) == []  # its own parts only
        assert a.replicate_once() == 5
        assert a.replicate_once() is None  # nothing newer
        own = parts.rank_dir(ma, 0) / checkpoint_name(5) / "model.safetensors"
        kept = parts.rank_dir(ma, 0, held=True) / checkpoint_name(5) / "model.safetensors"
        assert os.stat(own).st_ino == os.stat(kept).st_ino  # a link, not a second copy
        # The worker goes on and removes its part of 5: the step stays whole here.
        for f in own.parent.iterdir():
            f.unlink()
        own.parent.rmdir()
        assert whole(ma) == [(5, 2)]
        a.poll()
        (rep,) = ev.of("replicating")
        assert rep["step"] == 5 and rep["ranks"] == [1] and rep["peer"] == b.me
        # Newer steps: the held ones beyond the newest two go.
        for step in (6, 7):
            make_part(ma, 0, 2, step)
            make_part(mb, 1, 2, step)
            assert a.replicate_once() == step
        assert sorted({p.step for p in parts.list_parts(ma, None, origins=(parts.KEPT,))}) == \
            [6, 7]
        assert ev.of("replicating") == [rep]  # said once per peer
    finally:
        a.close()
        b.close()


def _survivor(tmp_path: Path) -> Path:
    """The memory dir of a node whose peer was lost: steps 4 and 5 whole in `held/` (its own
    part kept beside the lost node's copy)."""
    ma = tmp_path / "a"
    for step in (4, 5):
        make_part(ma, 0, 2, step, held=True)
        make_part(ma, 1, 2, step, held=True)
    return ma


def test_a_replacement_gathers_the_newest_whole_step_from_a_survivor(tmp_path, ck):
    ev = Events()
    ma, mc = _survivor(tmp_path), tmp_path / "c"
    make_part(ma, 0, 2, 6)  # its own newer part: 6 is not whole anywhere
    a, c = side(ck, ma, Events()), side(ck, mc, ev)
    try:
        assert c.gather(attempt=0) == 5
        assert whole(mc) == [(5, 2)]
        (g,) = ev.of("gathered")
        assert g["step"] == 5 and g["ranks"] == [0, 1] and g["bytes"] > 2 * 1_200_000
        assert c.gather(attempt=1) is None  # whole here already
        assert a.gather(attempt=1) is None  # the survivor lacks nothing newer
    finally:
        a.close()
        c.close()


def test_a_tampered_part_is_refused_and_an_older_step_gathered(tmp_path, ck):
    ev = Events()
    ma, mc = _survivor(tmp_path), tmp_path / "c"
    bad = parts.rank_dir(ma, 1, held=True) / checkpoint_name(5) / "model.safetensors"
    with open(bad, "r+b") as f:  # one byte, the size kept: only the content hash can tell
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    a, c = side(ck, ma, Events()), side(ck, mc, ev)
    try:
        assert c.gather(attempt=0) == 4
        (failed,) = ev.of("failed")
        assert failed["step"] == 5 and "rank 1's part" in failed["reason"]
        assert "model.safetensors" in failed["reason"], failed
        assert whole(mc) == [(4, 2)]  # 5 is not whole here: the ranks resume from 4
        assert not list((parts.rank_dir(mc, 1, held=True)).glob("*5*"))  # nothing half-copied
    finally:
        a.close()
        c.close()


def test_another_runs_peer_is_refused_with_a_reason(tmp_path, ck):
    ev = Events()
    mo, mc = tmp_path / "other", tmp_path / "c"
    make_part(mo, 0, 1, 9, run=OTHER)
    # A server of another run registered under this run's name (a stale or hostile entry).
    server = PeerServer(mo, OTHER, None, "127.0.0.1", secret=registry.run_secret(ck, OTHER))
    server.start()
    registry.register(ck, registry.Node("z-other", *server.address, RUN, time.time()),
                      secret=registry.run_secret(ck, RUN))
    c = side(ck, mc, ev)
    try:
        assert c.gather(attempt=0) is None
        (failed,) = ev.of("failed")
        assert failed["peer"] == "z-other" and "run" in failed["reason"], failed
        assert whole(mc) == []
    finally:
        c.close()
        server.close()


def test_a_peer_that_says_nothing_costs_its_timeout_not_a_hang(tmp_path, ck):
    ev = Events()
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    registry.register(ck, registry.Node("z-silent", *silent.getsockname()[:2], RUN, time.time()),
                      secret=registry.run_secret(ck, RUN))
    c = side(ck, tmp_path / "c", ev, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert c.gather(attempt=0) is None
        assert time.monotonic() - t0 < 3
        (failed,) = ev.of("failed")
        assert failed["peer"] == "z-silent" and "cannot list" in failed["reason"], failed
    finally:
        c.close()
        silent.close()
        for s in accepted:
            s.close()


def test_a_run_without_the_memory_tier_opens_no_port(tmp_path, ck):
    mem = tmp_path / "m"
    mem.mkdir()
    p = PeerSide(mem, ck, None, "127.0.0.1", Events().emit, print)
    assert not p.wanted(RUN)  # no parts here, no node of the run registered
    registry.register(ck, registry.Node("other", "127.0.0.1", 1, RUN, time.time()))
    assert p.wanted(RUN)  # a replacement joining a run whose ranks snapshot
    assert not p.wanted(OTHER)
    make_part(mem, 0, 1, 3)  # an earlier attempt's parts: wanted whatever is registered
    assert p.wanted(OTHER)
    assert not p.started


def test_entries_of_nodes_gone_for_an_hour_are_forgotten(ck):
    now = time.time()
    registry.register(ck, registry.Node("gone", "127.0.0.1", 1, RUN, now - 7200))
    registry.register(ck, registry.Node("here", "127.0.0.1", 2, RUN, now))
    old = ck / registry.REGISTRY / "gone.json"
    os.utime(old, (now - 7200, now - 7200))
    assert registry.forget_stale(ck, now) == 1
    assert not old.exists() and (ck / registry.REGISTRY / "here.json").exists()


@pytest.mark.parametrize("peer, says", [
    ({"state": "replicating", "peer": "n2", "step": 4, "reason": None}, "copying node n2's parts"),
    ({"state": "gathered", "peer": "n1", "step": 6, "reason": None}, "gathered step 6 from n1"),
    ({"state": "failed", "peer": "n2", "step": None, "reason": "cannot list its snapshots"},
     "peer copy from n2 failed: cannot list its snapshots"),
])
def test_status_says_the_peer_copies_last_news(peer, says):
    from rtrain.supervisor.commands.status import _memory_row

    assert says in _memory_row({"state": "on", "every": 1, "peer": peer})


def test_the_serving_address_is_the_one_that_reaches_the_rendezvous():
    assert serving_address("127.0.0.1", {}) == ("127.0.0.1", 0)
    assert serving_address(None, {}) == ("127.0.0.1", 0)
    assert serving_address("127.0.0.1", {"RTRAIN_PEER_HOST": "10.1.2.3",
                                         "RTRAIN_PEER_PORT": "7070"}) == ("10.1.2.3", 7070)
    for bad in ("seven", "70000", "-1"):
        with pytest.raises(ConfigError, match=r"RTRAIN_PEER_PORT=.* is not a port: set it"):
            serving_address(None, {"RTRAIN_PEER_PORT": bad})


# ---------------------------------------------------------------- pure decisions


@pytest.mark.parametrize("source, held, own, want", [
    ([], set(), set(), None),
    ([(1, 4), (1, 5)], set(), set(), (5, [1])),
    ([(1, 5), (2, 5)], {(1, 5)}, set(), (5, [2])),
    ([(1, 5)], {(1, 5)}, set(), None),
    ([(1, 4), (1, 5)], {(1, 4)}, set(), (5, [1])),  # only the newest: an older is superseded
    # The source a step ahead of this node: the newest step both have, so the copy and this
    # node's own parts make one step.
    ([(1, 5), (1, 6)], set(), {4, 5}, (5, [1])),
    ([(1, 6)], set(), {4, 5}, None),  # nothing in common yet
])
def test_next_copy(source, held, own, want):
    assert decide.next_copy(source, held, own) == want


def test_held_to_drop_keeps_the_newest_two_complete_and_the_newest():
    assert decide.held_to_drop({3, 5, 6, 7}, {3, 5, 6, 7}) == [5, 3]
    # 7 was pinned but its copy failed: 5 and 6 stay whole, 7 may complete yet, 3 goes.
    assert decide.held_to_drop({3, 5, 6, 7}, {3, 5, 6}) == [3]
    assert decide.held_to_drop({3, 5, 6, 7}, set()) == [6, 5, 3]
    assert decide.held_to_drop({5}, set()) == []


@pytest.mark.parametrize("local, remote, want", [
    # A replacement: nothing here, a survivor holds 5 whole and 6 of rank 0 only.
    (set(), {"a": {(0, 5, 2), (1, 5, 2), (0, 6, 2)}}, [(5, 2, {0: ["a"], 1: ["a"]})]),
    # Whole here already at 5: only newer steps are worth copying.
    ({(0, 5, 2), (1, 5, 2)}, {"a": {(0, 5, 2), (1, 5, 2)}}, []),
    # Two survivors each hold a part; this node holds rank 2.
    ({(2, 8, 3)}, {"a": {(0, 8, 3)}, "b": {(0, 8, 3), (1, 8, 3)}},
     [(8, 3, {0: ["a", "b"], 1: ["b"]})]),
    # A world size that changed: parts of one size never make another's step.
    (set(), {"a": {(0, 9, 2), (1, 9, 3), (0, 9, 3)}}, []),
])
def test_gather_plan(local, remote, want):
    assert decide.gather_plan(local, remote) == want


@pytest.mark.parametrize("every_rank, size, disk, want", [
    ([[(7, 2), (6, 2)], [(6, 2), (5, 2)]], 2, None, 6),  # the newest whole on every rank
    ([[(7, 2)], [(6, 2)]], 2, None, None),  # no step in common: the disk tier
    ([[(7, 2)], [(7, 2)]], 2, 8, None),  # older than the disk's
    ([[(7, 2)], [(7, 2)]], 2, 7, 7),  # the disk's step: the same state, read from memory
    ([[(7, 2)], [(7, 2)]], 2, 5, 7),
    ([[(7, 3)], [(7, 3)]], 2, None, None),  # another world size's parts
    ([[], [(7, 2)]], 2, None, None),  # a rank whose node has none
])
def test_the_group_step_from_memory(every_rank, size, disk, want):
    assert memory_resume.choose(every_rank, size, disk) == want
