"""Peer copies of the memory tier: a node's rtrain serves its parts (supervisor/memtier/
peerserver.py), another copies one (peerfetch.py), and the registry in the checkpoint dir says
where each node listens (registry.py). Real sockets on 127.0.0.1, real parts written by the
commit protocol, threads only: no process is started."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from conftest import make_part

from rtrain.checkpoint import hashing, parts
from rtrain.checkpoint.layout import MANIFEST, checkpoint_name
from rtrain.checkpoint.verify import Level, verify
from rtrain.supervisor.memtier import peerfetch, peerwire, registry
from rtrain.supervisor.memtier.peerfetch import (
    NoRoom,
    PeerBusy,
    PeerRefused,
    PeerUnreachable,
    Session,
    fetch_part,
    list_remote,
)
from rtrain.supervisor.memtier.peerserver import PeerServer

RUN = "1" * 32
OTHER_RUN = "2" * 32
KEY = hashing.derive_key(b"the run's signing key")
WRONG_KEY = hashing.derive_key(b"another secret")
SECRET = bytes(range(32))  # an unsigned run's peer key (registry.run_secret)
MODEL = "model.safetensors"  # make_part's file over a chunk, so it streams


@contextlib.contextmanager
def serving(memory_dir: Path, run: str | None = RUN, key: bytes | None = None, **kw):
    kw.setdefault("secret", key or SECRET)
    server = PeerServer(memory_dir, run, key, **kw)
    server.start()
    try:
        yield server
    finally:
        server.close()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `root` with its size and mtime: what a read-only server must keep."""
    return {p.relative_to(root).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def held_dest(memory_dir: Path, part) -> Path:
    return parts.rank_dir(memory_dir, part.rank, held=True) / checkpoint_name(part.step)


def the_part(listing, rank: int, step: int, origin: str = parts.OWN):
    return next(p for p in listing if (p.rank, p.step, p.origin) == (rank, step, origin))


@pytest.mark.parametrize("key", [None, KEY], ids=["unsigned", "signed"])
def test_a_listed_part_is_fetched_whole_and_verifies(tmp_path, key):
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    for rank in (0, 1):
        make_part(a, rank, 2, 10, key=key)
    make_part(a, 0, 2, 8, key=key, held=True)  # a part node a holds for another node
    make_part(a, 1, 2, 12, run=OTHER_RUN, key=key)  # another run's: never listed
    before = tree(a)
    with serving(a, RUN, key) as server:
        listing = list_remote(server.address, RUN, key, secret=key or SECRET)
        assert [(p.rank, p.step, p.origin) for p in listing] == [
            (0, 10, "own"), (1, 10, "own"), (0, 8, "held")]
        part = the_part(listing, 0, 10)
        assert part.world_size == 2 and part.bytes > 1 << 20
        dest = held_dest(b, part)
        assert fetch_part(server.address, part, dest, RUN, key, secret=key or SECRET) == dest
    v = verify(dest, Level.FULL, key)
    assert v.ok, v.reason
    src = a / "rank-0" / checkpoint_name(10)
    assert sorted(os.listdir(dest)) == sorted(os.listdir(src))
    for name in os.listdir(src):
        assert (dest / name).read_bytes() == (src / name).read_bytes(), name
    for d in (b / parts.HELD, dest.parent, dest):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert os.listdir(dest.parent) == [dest.name]  # no temp dir left
    assert tree(a) == before  # the server wrote nothing


def test_a_part_already_held_is_not_fetched_again(tmp_path):
    a = tmp_path / "node-a"
    make_part(a, 0, 1, 5)
    with serving(a) as server:
        part = list_remote(server.address, RUN, None, secret=SECRET)[0]
        addr = server.address
    dest = held_dest(tmp_path / "node-b", part)
    dest.mkdir(parents=True)
    # The server is gone: nothing is asked of it.
    assert fetch_part(addr, part, dest, RUN, None, secret=SECRET, timeout_s=1) == dest


def _raw_handshake(addr, answer) -> dict:
    """The server's reply to `answer(greeting)`, sent from a plain socket."""
    with socket.create_connection(addr, timeout=5) as s, s.makefile("rwb") as f:
        greet = json.loads(f.readline())
        f.write(json.dumps(answer(greet)).encode() + b"\n")
        f.flush()
        return json.loads(f.readline())


def test_the_server_refuses_a_client_of_another_run(tmp_path):
    make_part(tmp_path, 0, 1, 5)
    with serving(tmp_path) as server:
        reply = _raw_handshake(server.address, lambda g: {"run": OTHER_RUN, "nonce": "a" * 32,
                                                          "proof": None})
    assert reply["ok"] is False and "another run" in reply["error"]
    assert OTHER_RUN[:8] in reply["error"] and RUN[:8] in reply["error"]


@pytest.mark.parametrize("client_key", [SECRET, WRONG_KEY], ids=["peer-key", "wrong-key"])
def test_the_server_refuses_a_client_without_the_runs_key(tmp_path, client_key):
    make_part(tmp_path, 0, 1, 5, key=KEY)
    with serving(tmp_path, RUN, KEY) as server:
        with pytest.raises(PeerRefused, match="bad or missing proof") as e:
            list_remote(server.address, RUN, None, secret=client_key)
        # A client that answers the nonce with the right key is let in (the check can pass).
        assert len(list_remote(server.address, RUN, KEY)) == 1
    assert "\n" not in str(e.value)


def test_the_client_refuses_a_server_of_another_run_or_without_the_key(tmp_path):
    make_part(tmp_path, 0, 1, 5, run=OTHER_RUN)
    with serving(tmp_path, OTHER_RUN, None) as server, \
            pytest.raises(PeerRefused, match=f"serves run {OTHER_RUN[:8]}, not this run"):
        list_remote(server.address, RUN, None, secret=SECRET)
    # A server that lets anyone in but cannot prove it holds the secret: it may be anyone's.
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        def let_in():
            conn, _ = impostor.accept()
            with conn, conn.makefile("rwb") as f:
                f.write(json.dumps({"rtrain_peer": peerwire.PROTOCOL, "run": RUN,
                                    "nonce": "0" * 32}).encode() + b"\n")
                f.flush()
                f.readline()
                f.write(json.dumps({"ok": True, "proof": "0" * 64}).encode() + b"\n")
                f.flush()
                f.readline()

        threading.Thread(target=let_in, daemon=True).start()
        with pytest.raises(PeerRefused, match="does not prove it holds the run's secret"):
            list_remote(impostor.getsockname()[:2], RUN, KEY)


def _fetch_refused(tmp_path, server, part, key=None, match=""):
    """fetch_part raises PeerRefused matching `match` and leaves the held dir as it was."""
    parent = tmp_path / "node-b" / parts.HELD / f"rank-{part.rank}"
    parent.mkdir(parents=True, exist_ok=True)
    (parent / "keep-me").write_text("x")
    with pytest.raises(PeerRefused, match=match) as e:
        fetch_part(server.address, part, parent / checkpoint_name(part.step), RUN, key,
                   secret=key or SECRET)
    assert os.listdir(parent) == ["keep-me"]
    return str(e.value)


def test_a_byte_changed_on_the_peer_after_listing_is_refused(tmp_path):
    a = tmp_path / "node-a"
    src = make_part(a, 0, 1, 5, key=KEY)
    with serving(a, RUN, KEY) as server:
        part = list_remote(server.address, RUN, KEY)[0]
        with open(src / MODEL, "r+b") as f:  # same size: only the hash can tell
            f.seek(1 << 20)
            byte = f.read(1)
            f.seek(1 << 20)
            f.write(bytes([byte[0] ^ 0xFF]))
        msg = _fetch_refused(tmp_path, server, part, KEY, "content hash does not match")
    assert MODEL in msg


def test_a_file_truncated_on_the_peer_is_refused(tmp_path):
    a = tmp_path / "node-a"
    src = make_part(a, 0, 1, 5)
    with serving(a) as server:
        part = list_remote(server.address, RUN, None, secret=SECRET)[0]
        os.truncate(src / MODEL, 1000)
        msg = _fetch_refused(tmp_path, server, part, None, "truncated or rewritten")
    assert MODEL in msg


def test_a_file_truncated_during_the_transfer_is_refused(tmp_path):
    """Truncated after the manifest came, on the same connection: the size sent is checked."""
    a = tmp_path / "node-a"
    src = make_part(a, 0, 1, 5)
    with serving(a) as server:
        part = list_remote(server.address, RUN, None, secret=SECRET)[0]
        with Session(server.address, RUN, None, secret=SECRET) as s:
            size = s.open_file(part, MANIFEST)
            assert b"".join(bytes(c) for c in s.chunks(size, MANIFEST))
            os.truncate(src / MODEL, 1000)
            assert s.open_file(part, MODEL) == 1000  # the server says what it has
        _fetch_refused(tmp_path, server, part, None, MODEL)


def test_a_manifest_whose_signature_does_not_verify_is_refused(tmp_path):
    a = tmp_path / "node-a"
    make_part(a, 0, 1, 5, key=KEY)
    with serving(a, RUN, KEY) as server:
        part = list_remote(server.address, RUN, KEY)[0]
        forged = dataclasses.replace(part, manifest={**part.manifest, "samples_seen": 1})
        _fetch_refused(tmp_path, server, forged, KEY, "signature does not match")
        # A manifest the listing did not give is refused too (unsigned run: no signature).


def test_a_part_that_is_not_the_one_asked_for_is_refused(tmp_path):
    a = tmp_path / "node-a"
    make_part(a, 1, 2, 5)
    with serving(a) as server:
        part = list_remote(server.address, RUN, None, secret=SECRET)[0]
        _fetch_refused(tmp_path, server, dataclasses.replace(part, step=6),
                       match="not the part asked for")
        _fetch_refused(tmp_path, server, dataclasses.replace(part, rank=0),
                       match="not the part asked for")
        # Unsigned, the listing's manifest can say anything: the peer's file must agree.
        changed = dataclasses.replace(part, manifest={**part.manifest, "samples_seen": 1})
        _fetch_refused(tmp_path, server, changed, match="not the manifest its listing gave")


def test_a_part_larger_than_the_free_space_is_refused_before_it_is_received(
        tmp_path, monkeypatch):
    a = tmp_path / "node-a"
    make_part(a, 0, 1, 5)
    with serving(a) as server:
        part = list_remote(server.address, RUN, None, secret=SECRET)[0]
        real = os.statvfs

        def small(path):
            st = real(path)
            # f_bavail * f_frsize: a filesystem with 1 MiB free, less than the part.
            return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 256, 256, *st[5:]))

        monkeypatch.setattr(peerfetch.os, "statvfs", small)
        with pytest.raises(NoRoom, match=r"needs \d+ bytes"):
            fetch_part(server.address, part, held_dest(tmp_path / "b", part), RUN, None,
                       secret=SECRET)
        assert os.listdir(tmp_path / "b" / parts.HELD / "rank-0") == []


class _FakePeer:
    """A peer that lists a real part, sends its manifest, then half of the next file and goes
    silent (`close=False`) or closes the connection (`close=True`)."""

    def __init__(self, part_dir: Path, close: bool) -> None:
        self.part_dir, self.close = part_dir, close
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.1)
        while not self.done.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            self._session(conn)

    def _session(self, conn: socket.socket) -> None:
        with conn:  # a peer of the run: it holds the secret and speaks the protocol
            wire = peerwire.Wire(conn, 30, "client")
            nonce = "0" * 32
            wire.send_line({"rtrain_peer": peerwire.PROTOCOL, "run": RUN, "nonce": nonce})
            hello = wire.read_line(peerwire.REQUEST_LIMIT, "hello")
            session = peerwire.session_key(SECRET, RUN, nonce, hello["nonce"])
            wire.send_line({"ok": True, "proof": peerwire.proof(session, "server")})
            wire.seal(session, sending=peerwire.TO_CLIENT, receiving=peerwire.TO_SERVER)
            m = json.loads((self.part_dir / MANIFEST).read_bytes())
            while (req := wire.read_line(peerwire.REQUEST_LIMIT, "a request",
                                         eof_ok=True)) is not None:
                if req["op"] == "list":
                    wire.send_line({"parts": [{"rank": 0, "step": 5, "world_size": 1,
                                               "origin": "own", "bytes": 0, "manifest": m}]})
                    continue
                data = (self.part_dir / req["file"]).read_bytes()
                wire.send_line({"size": len(data)})
                if req["file"] == MANIFEST:
                    wire.send_frame(data)  # under a chunk: one frame
                    continue
                wire.send(data[:len(data) // 2])  # half of the first chunk, no tag
                if not self.close:
                    self.done.wait(30)
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize("close", [False, True], ids=["goes-silent", "closes"])
def test_a_peer_that_stops_mid_file_is_unreachable_within_the_timeout(tmp_path, close):
    src = make_part(tmp_path / "node-a", 0, 1, 5)
    peer = _FakePeer(src, close)
    try:
        addr = peer.listener.getsockname()[:2]
        with Session(addr, RUN, None, secret=SECRET, timeout_s=2) as s:
            part = s.list()[0]
        dest = held_dest(tmp_path / "node-b", part)
        timeout = 0.5
        started = time.monotonic()
        with pytest.raises(PeerUnreachable) as e:
            fetch_part(addr, part, dest, RUN, None, secret=SECRET, timeout_s=timeout)
        elapsed = time.monotonic() - started
    finally:
        peer.stop()
    assert elapsed < timeout + 1.5
    said = "closed the connection in the middle of" if close else "stopped sending"
    assert f"{said} {MODEL}" in str(e.value)
    assert os.listdir(dest.parent) == []


def _get(s: Session, part, name: str) -> dict:
    return s.request({"op": "get", "rank": part.rank, "step": part.step, "origin": part.origin,
                      "file": name})


def test_nothing_outside_a_listed_part_is_served(tmp_path):
    a = tmp_path / "node-a"
    src = make_part(a, 0, 1, 5)
    (src / "extra.bin").write_bytes(b"not listed")
    (a / "rank-0" / "x").write_bytes(b"beside the part")
    with serving(a) as server, Session(server.address, RUN, None, secret=SECRET) as s:
        part = s.list()[0]
        for name, why in [("../x", "leaves the checkpoint"), ("/etc/passwd", "absolute"),
                          ("extra.bin", "not a file of that part")]:
            reply = _get(s, part, name)
            assert "size" not in reply and why in reply["error"], name
        unlisted = dataclasses.replace(part, step=4)
        assert "no part of rank 0 at step 4" in _get(s, unlisted, MANIFEST)["error"]
        # The connection is still usable: a listed file is sent.
        assert "size" in _get(s, part, MODEL)


def test_a_link_in_a_part_is_never_followed(tmp_path):
    a = tmp_path / "node-a"
    src = make_part(a, 0, 1, 5)
    os.rename(src / MODEL, src / "model.real")
    os.symlink("model.real", src / MODEL)  # inside the part: the quick check passes
    with serving(a) as server, Session(server.address, RUN, None, secret=SECRET) as s:
        part = s.list()[0]
        reply = _get(s, part, MODEL)
    assert "size" not in reply and "symbolic link" in reply["error"]


def test_one_client_more_than_allowed_is_told_busy_at_once(tmp_path):
    make_part(tmp_path, 0, 1, 5)
    with serving(tmp_path, max_clients=2, timeout_s=5) as server:
        # Authenticated: each holds a slot while it says nothing.
        held = [Session(server.address, RUN, None, secret=SECRET) for _ in range(2)]
        started = time.monotonic()
        with pytest.raises(PeerBusy, match="busy: serving 2 clients"):
            list_remote(server.address, RUN, None, secret=SECRET)
        assert time.monotonic() - started < 1.0
        for s in held:
            s.close()
        deadline = time.monotonic() + 3
        while True:  # the slots come back as the server sees the connections end
            try:
                assert len(list_remote(server.address, RUN, None, secret=SECRET)) == 1
                break
            except PeerBusy:
                assert time.monotonic() < deadline
                time.sleep(0.05)


def test_a_closed_server_is_unreachable(tmp_path):
    server = PeerServer(tmp_path, RUN, None, secret=SECRET)
    server.start()
    addr = server.address
    server.close()
    server.close()  # idempotent
    with pytest.raises(PeerUnreachable, match="cannot connect"):
        list_remote(addr, RUN, None, secret=SECRET, timeout_s=1)


def _node(name: str, run: str | None = RUN) -> registry.Node:
    return registry.Node(name, "10.0.0.1", 29400, run, 0.0)


def test_the_registry_lists_the_live_nodes_of_the_run(tmp_path):
    now = 1_000_000.0
    registry.register(tmp_path, _node("b-1-0002"), now=now - 5)
    registry.register(tmp_path, _node("a-1-0001"), now=now)
    registry.register(tmp_path, _node("c-1-0003"), now=now - registry.STALE_S - 1)  # stale
    registry.register(tmp_path, _node("d-1-0004", OTHER_RUN), now=now)
    reg = tmp_path / registry.REGISTRY
    (reg / "e-1-0005.json").write_text("{not json")
    (reg / "f-1-0006.json").write_text(json.dumps({"v": 1, "node": "f-1-0006", "host": "h",
                                                   "port": 0, "run": RUN, "updated": now}))
    os.symlink(reg / "a-1-0001.json", reg / "g-1-0007.json")  # a link is not read
    live = registry.live_nodes(tmp_path, RUN, now)
    assert [(n.node, n.host, n.port, n.updated) for n in live] == [
        ("a-1-0001", "10.0.0.1", 29400, now), ("b-1-0002", "10.0.0.1", 29400, now - 5)]
    assert [n.node for n in registry.live_nodes(tmp_path, OTHER_RUN, now)] == ["d-1-0004"]
    registry.unregister(tmp_path, "a-1-0001")
    registry.unregister(tmp_path, "a-1-0001")  # gone already: fine
    assert [n.node for n in registry.live_nodes(tmp_path, RUN, now)] == ["b-1-0002"]
    assert registry.live_nodes(tmp_path / "nowhere", RUN, now) == []
    with pytest.raises(ValueError):
        registry.register(tmp_path, _node("../escape"))


def test_node_ids_are_unique_per_launch_and_name_the_host():
    a, b = registry.node_id(), registry.node_id()
    host, pid, tail = a.rsplit("-", 2)
    assert a != b and pid == str(os.getpid()) and re.fullmatch("[0-9a-f]{4}", tail)
    assert host == re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:150]


def test_each_node_copies_from_its_ring_predecessor():
    one, two, three = _node("n1"), _node("n2"), _node("n3")
    assert registry.source_of([one], "n1") is None
    assert registry.source_of([], "n1") is None
    assert registry.source_of([one, two], "n1") == two
    assert registry.source_of([one, two], "n2") == one
    nodes = [three, one, two]  # the order given does not matter
    assert [registry.source_of(nodes, n).node for n in ("n1", "n2", "n3")] == ["n3", "n1", "n2"]
    assert registry.source_of([one, three], "n2") == one  # not registered yet: its place counts


def test_a_file_where_a_rank_dir_goes_is_passed_over(tmp_path):
    make_part(tmp_path, 0, 1, 5)
    (tmp_path / "rank-3").write_text("a file where a rank dir goes")
    (tmp_path / "rank-4").symlink_to(tmp_path / "rank-0")
    with serving(tmp_path) as server:
        listing = list_remote(server.address, RUN, None, secret=SECRET)
        assert [(p.rank, p.step) for p in listing] == [(0, 5)]
