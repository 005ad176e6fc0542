"""Peer copies against a party that is not a node of the run (supervisor/memtier/): a link or
file planted at the registry's name in the checkpoint dir, a relay that passes the handshake
through, anyone who reaches the peer port of a run without a signing key, idle sockets held
open to starve the run's own nodes, a wildcard bind address. Real sockets on 127.0.0.0/8, real
files, real other uids; threads only, no process is started."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from conftest import PART_RUN, make_part
from conftest import PeerEvents as Events

from rtrain.checkpoint import hashing
from rtrain.supervisor.core.ownfiles import RefusedFile
from rtrain.supervisor.memtier import peerserver, peerside, peerwire, registry
from rtrain.supervisor.memtier.peerfetch import (
    PeerBusy,
    PeerRefused,
    PeerUnreachable,
    Session,
    fetch_part,
    list_remote,
)
from rtrain.supervisor.memtier.peerserver import PeerServer
from rtrain.supervisor.memtier.peerside import PeerSide, PeersOff, published_host
from rtrain.supervisor.memtier.tier import MemoryTierDir

RUN = PART_RUN
KEY = hashing.derive_key(b"the run's signing key")
MODEL = "model.safetensors"
HOUR = 3600


def _victim_dir(root: Path) -> tuple[Path, dict[str, bytes]]:
    """Another directory's files, old enough for the registry's clean-up (an hour)."""
    victim = root / "victim"
    victim.mkdir()
    files = {"settings.json": b'{"mine": 1}', "notes.txt": b"keep"}
    for name, data in files.items():
        (victim / name).write_bytes(data)
        os.utime(victim / name, (time.time() - 2 * HOUR,) * 2)
    return victim, files


def _untouched(victim: Path, files: dict[str, bytes]) -> None:
    assert sorted(os.listdir(victim)) == sorted(files)
    for name, data in files.items():
        assert (victim / name).read_bytes() == data


# ---------------------------------------------------------------- a planted registry


def test_a_link_planted_at_the_registry_turns_peer_copies_off_and_touches_nothing(tmp_path, ck):
    victim, files = _victim_dir(tmp_path)
    os.symlink(victim, ck / registry.REGISTRY)
    ev = Events()
    tier = MemoryTierDir(ck, None, ev.emit, ev.said.append, path=tmp_path / "shm")
    tier.enable_peers("127.0.0.1")
    tier.attempt_starting(0)
    try:
        assert tier.peers is None  # off for the launch
        (line,) = [s for s in ev.said if "peer copies" in s]
        assert "\n" not in line and "is a symbolic link" in line, line
        assert str(ck / registry.REGISTRY) in line
        _untouched(victim, files)  # nothing removed, nothing written there
        assert os.path.islink(ck / registry.REGISTRY)
    finally:
        tier.close(None)


@pytest.mark.parametrize("planted", ["link", "file", "fifo"])
def test_every_registry_use_refuses_a_planted_name(tmp_path, ck, planted):
    victim, files = _victim_dir(tmp_path)
    reg = ck / registry.REGISTRY
    if planted == "link":
        os.symlink(victim, reg)
    elif planted == "file":
        reg.write_text("not a directory")
    else:
        os.mkfifo(reg)
    node = registry.Node("n1", "127.0.0.1", 1, RUN, time.time())
    calls = [lambda: registry.forget_stale(ck, time.time() + 10 * HOUR),
             lambda: registry.live_nodes(ck, RUN, time.time()),
             lambda: registry.register(ck, node),
             lambda: registry.unregister(ck, "n1"),
             lambda: registry.run_secret(ck, RUN)]
    for call in calls:
        with pytest.raises(RefusedFile, match=r"rtrain never follows|not a directory"):
            call()
    _untouched(victim, files)
    side = PeerSide(tmp_path / "m", ck, None, "127.0.0.1", Events().emit, print)
    with pytest.raises(PeersOff):
        side.start(RUN)
    assert not side.started


def test_entries_that_are_links_fifos_or_too_large_are_passed_over_without_blocking(ck):
    now = time.time()
    registry.register(ck, registry.Node("good", "127.0.0.1", 1, RUN, now))
    reg = ck / registry.REGISTRY
    os.mkfifo(reg / "fifo.json")  # a plain open() of it would wait for a writer forever
    os.symlink(reg / "good.json", reg / "link.json")
    (reg / "huge.json").write_bytes(b" " * (1 << 20))
    (reg / ".good.json.0123456789ab.tmp").write_text("left by a killed rtrain")
    done: list = []
    t = threading.Thread(target=lambda: done.append(registry.live_nodes(ck, RUN, now)),
                         daemon=True)
    t.start()
    t.join(10)
    assert done and [n.node for n in done[0]] == ["good"]
    # The clean-up removes old entries of the registry itself, never a FIFO's or link's target.
    assert registry.forget_stale(ck, now + 10 * HOUR) == 3  # good, huge and the temp file
    assert sorted(os.listdir(reg)) == ["fifo.json", "link.json"]


# ---------------------------------------------------------------- the run's peer key


def test_an_unsigned_run_shares_one_owner_only_peer_key(ck):
    a, b = registry.run_secret(ck, RUN), registry.run_secret(ck, RUN)
    assert a == b and len(a) == 32
    (path,) = (ck / registry.REGISTRY).glob("*.key")
    st = path.lstat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert stat.S_IMODE((ck / registry.REGISTRY).lstat().st_mode) == 0o700
    assert registry.run_secret(ck, "2" * 32) != a  # another run, another key


def test_nodes_starting_at_once_all_read_the_first_ones_key(ck):
    got: list[bytes] = []
    start = threading.Barrier(8)

    def node():
        start.wait()
        got.append(registry.run_secret(ck, RUN))

    threads = [threading.Thread(target=node) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and len(set(got)) == 1
    assert [p.name for p in (ck / registry.REGISTRY).iterdir()] == [f"run-{RUN}.key"]


@pytest.mark.parametrize("planted", ["readable", "another-user", "link", "garbage"])
def test_a_peer_key_rtrain_did_not_write_for_this_user_is_refused(tmp_path, ck, planted):
    registry.run_secret(ck, RUN)
    (path,) = (ck / registry.REGISTRY).glob("*.key")
    if planted == "readable":
        path.chmod(0o644)
    elif planted == "another-user":
        os.chown(path, 65534, 65534)  # a teammate's file: they know the key in it
    elif planted == "link":
        path.unlink()
        (tmp_path / "theirs").write_text("00" * 32)
        os.symlink(tmp_path / "theirs", path)
    else:
        path.write_text("not a key")
    side = PeerSide(tmp_path / "m", ck, None, "127.0.0.1", Events().emit, print)
    with pytest.raises(PeersOff) as e:
        side.start(RUN)
    assert "\n" not in str(e.value) and path.name in str(e.value)
    assert not side.started


# ---------------------------------------------------------------- without a signing key


def _raw(addr, hello) -> tuple[dict, dict, socket.socket]:
    """A plain socket's handshake: the greeting, the server's answer to `hello(greeting)`."""
    s = socket.create_connection(addr, timeout=5)
    f = s.makefile("rwb")
    greet = json.loads(f.readline())
    f.write(json.dumps(hello(greet)).encode() + b"\n")
    f.flush()
    return greet, json.loads(f.readline() or b"{}"), s


def test_an_outsider_cannot_read_an_unsigned_runs_parts(tmp_path, ck):
    """Before: whoever reached the port learned the run from the greeting, echoed it with no
    MAC and was served every part."""
    mem = tmp_path / "m"
    make_part(mem, 0, 1, 5)
    side = PeerSide(mem, ck, None, "127.0.0.1", Events().emit, print, interval_s=3600)
    side.start(RUN)
    try:
        addr = side.address
        for hello in (lambda g: {"run": g["run"], "nonce": "a" * 32, "mac": None},
                      lambda g: {"run": g["run"], "nonce": "a" * 32, "proof": "0" * 64}):
            _, answer, s = _raw(addr, hello)
            with s:
                assert answer.get("ok") is False, answer
        with pytest.raises(PeerRefused, match="bad or missing proof"):
            list_remote(addr, RUN, None, secret=os.urandom(32))
        # The run's own nodes (the key file in the checkpoint dir) are served.
        assert len(list_remote(addr, RUN, None, secret=registry.run_secret(ck, RUN))) == 1
    finally:
        side.close()


def test_a_forged_registry_entry_gets_no_part_gathered(tmp_path, ck):
    """An outsider's server, of this run's id, holding parts it made, registered in the
    checkpoint dir: a node gathers nothing from it. Its entry has no MAC, so it is not even
    asked; an entry that has one (a real node's, replayed once its port was taken) gets the
    outsider refused at the handshake."""
    theirs = tmp_path / "theirs"
    make_part(theirs, 0, 1, 9)
    forged = PeerServer(theirs, RUN, None, "127.0.0.1", secret=os.urandom(32))
    forged.start()
    ev = Events()
    mem = tmp_path / "m"
    mem.mkdir()
    side = PeerSide(mem, ck, None, "127.0.0.1", ev.emit, ev.said.append, interval_s=3600)
    side.start(RUN)
    try:
        registry.register(ck, registry.Node("a-forged", *forged.address, RUN, time.time()))
        assert side.gather(attempt=0) is None
        assert ev.got == []  # passed over unread
        registry.register(ck, registry.Node("a-forged", *forged.address, RUN, time.time()),
                          secret=registry.run_secret(ck, RUN))
        assert side.gather(attempt=0) is None
        failed = [e for e in ev.got if e.get("state") == "failed"]
        # It cannot check this node's proof, so it refuses it (and could not prove its own).
        assert failed and "does not hold this run's secret" in failed[0]["reason"], failed
        assert not list(mem.rglob("*.safetensors"))
    finally:
        side.close()
        forged.close()


def test_a_forged_entry_cannot_take_a_nodes_place_in_the_ring(tmp_path, ck):
    """Before: an entry named to sort last became the first node's source, and that node's
    predecessor's parts went uncopied."""
    ma, mb = tmp_path / "a", tmp_path / "b"
    make_part(ma, 0, 2, 5)
    make_part(mb, 1, 2, 5)
    a = PeerSide(ma, ck, None, "127.0.0.1", Events().emit, print, interval_s=3600)
    b = PeerSide(mb, ck, None, "127.0.0.1", Events().emit, print, interval_s=3600)
    a.start(RUN)
    b.start(RUN)
    try:
        registry.register(ck, registry.Node("zzzzzzzz-forged", "127.0.0.1", 9, RUN, time.time()))
        first = min((a, b), key=lambda s: s.me)
        assert first.replicate_once() == 5  # from the other node, not the forged one
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- a relay


class _Relay:
    """A party a node connects to (a forged registry entry): it passes the handshake through
    to a real node's server, then sends a `get` of its own on that connection and records
    what the server sends back."""

    def __init__(self, server_addr) -> None:
        self.server_addr = server_addr
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.got = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def address(self):
        return self.listener.getsockname()[:2]

    def _run(self) -> None:
        client, _ = self.listener.accept()
        with client, socket.create_connection(self.server_addr, timeout=5) as server:
            cf, sf = client.makefile("rwb"), server.makefile("rwb")
            for src, dst in ((sf, cf), (cf, sf), (sf, cf)):  # greeting, hello, answer
                dst.write(src.readline())
                dst.flush()
            get = {"op": "get", "rank": 0, "step": 5, "origin": "own", "file": MODEL}
            # Its own request, with a tag it cannot compute (and without one: it waits).
            sf.write(json.dumps(get).encode() + b"\n" + os.urandom(peerwire.TAG))
            sf.flush()
            server.settimeout(5)
            with contextlib.suppress(OSError):
                while chunk := server.recv(1 << 16):
                    self.got += chunk

    def stop(self) -> None:
        self.thread.join(10)
        self.listener.close()


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_a_relay_that_passes_the_handshake_through_cannot_send_its_own_get(tmp_path, ck,
                                                                          signed):
    mem = tmp_path / "m"
    make_part(mem, 0, 1, 5, key=KEY if signed else None)
    key = KEY if signed else None
    secret = KEY if signed else registry.run_secret(ck, RUN)
    with contextlib.closing(PeerServer(mem, RUN, key, secret=secret)) as server:
        server.start()
        relay = _Relay(server.address)
        try:
            # The real node's handshake goes through the relay and succeeds.
            with Session(relay.address, RUN, key, secret=secret, timeout_s=5):
                relay.thread.join(10)
        finally:
            relay.stop()
    assert not relay.thread.is_alive()
    assert b"size" not in relay.got and len(relay.got) < 1000, relay.got[:200]


class _Flipper:
    """A party on the path: forwards both ways, and changes one bit of what the server sends
    at byte `at` (inside a file, past the handshake and the listing)."""

    def __init__(self, server_addr, at: int) -> None:
        self.server_addr, self.at = server_addr, at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.server_addr, timeout=10)

        def pipe(src, dst, flip):
            seen = 0
            with contextlib.suppress(OSError):
                while data := src.recv(1 << 16):
                    if flip and seen <= self.at < seen + len(data):
                        data = bytearray(data)
                        data[self.at - seen] ^= 1
                    seen += len(data)
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        threading.Thread(target=pipe, args=(client, server, False), daemon=True).start()
        pipe(server, client, True)
        client.close()
        server.close()


def test_a_byte_changed_on_the_way_is_refused_as_it_arrives(tmp_path, ck):
    mem = tmp_path / "m"
    make_part(mem, 0, 1, 5)
    secret = registry.run_secret(ck, RUN)
    with contextlib.closing(PeerServer(mem, RUN, None, secret=secret)) as server:
        server.start()
        part = list_remote(server.address, RUN, None, secret=secret)[0]
        flipper = _Flipper(server.address, at=200_000)  # the listing is a few KiB
        dest = tmp_path / "b" / "checkpoint-5"
        with pytest.raises(PeerRefused, match="not authenticated"):
            fetch_part(flipper.address, part, dest, RUN, None, secret=secret)
        flipper.listener.close()
    assert not dest.exists()


# ---------------------------------------------------------------- idle sockets


class _Squatter:
    """Connections from 127.0.0.2 that say nothing, reopened as soon as the server closes
    them: what kept the run's own node refused as busy."""

    def __init__(self, addr, count: int) -> None:
        self.addr, self.count = addr, count
        self.stop = threading.Event()
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket | None:
        s = socket.socket()
        try:
            s.bind(("127.0.0.2", 0))
            s.connect(self.addr)
        except OSError:
            s.close()
            return None
        s.setblocking(False)
        self.opened += 1
        return s

    def _run(self) -> None:
        socks = [s for _ in range(self.count) if (s := self._open())]
        while not self.stop.is_set():
            for i, s in enumerate(socks):
                try:
                    closed = s.recv(4096) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    s.close()
                    socks[i] = self._open() or s
            time.sleep(0.05)
        for s in socks:
            s.close()


def test_idle_sockets_held_open_do_not_stop_the_runs_own_copies(tmp_path, ck):
    mem = tmp_path / "m"
    make_part(mem, 0, 1, 5)
    secret = registry.run_secret(ck, RUN)
    with contextlib.closing(PeerServer(mem, RUN, None, secret=secret, max_clients=4,
                                       timeout_s=10)) as server:
        server.start()
        squat = _Squatter(server.address, 8)  # twice the slots, twice the per-address limit
        try:
            time.sleep(0.5)  # every socket open before the node copies
            refused, copied = 0, 0
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                try:
                    part = list_remote(server.address, RUN, None, secret=secret,
                                       timeout_s=5)[0]
                    dest = tmp_path / "b" / f"copy-{copied}" / "checkpoint-5"
                    fetch_part(server.address, part, dest, RUN, None, secret=secret)
                    copied += 1
                except (PeerBusy, PeerUnreachable):
                    refused += 1
                time.sleep(0.1)
        finally:
            squat.stop.set()
            squat.thread.join(5)
    assert refused == 0 and copied >= 3, (refused, copied)
    assert squat.opened > 8  # the server closed idle sockets, and they came back


def test_a_connection_silent_in_its_handshake_is_closed_within_the_preauth_deadline(ck):
    secret = registry.run_secret(ck, RUN)
    with contextlib.closing(PeerServer(ck, RUN, None, secret=secret, timeout_s=10)) as server:
        server.start()
        with socket.create_connection(server.address, timeout=10) as s:
            t0 = time.monotonic()
            assert b"rtrain_peer" in s.recv(4096)
            assert s.recv(4096) == b""  # closed by the server
            assert time.monotonic() - t0 < peerserver.PREAUTH_S + 1.5


def test_one_address_gets_only_a_few_handshakes_at_once(ck):
    secret = registry.run_secret(ck, RUN)
    with contextlib.closing(PeerServer(ck, RUN, None, secret=secret)) as server:
        server.start()
        socks = []
        try:
            for _ in range(peerserver.PREAUTH_PER_ADDRESS + 3):
                s = socket.socket()
                s.bind(("127.0.0.3", 0))
                s.connect(server.address)
                s.settimeout(5)
                socks.append(s)
            greeted = sum(b"rtrain_peer" in s.recv(4096) for s in socks)
            assert greeted == peerserver.PREAUTH_PER_ADDRESS
            # Another address is not held up by them.
            assert list_remote(server.address, RUN, None, secret=secret) == []
        finally:
            for s in socks:
                s.close()


# ---------------------------------------------------------------- the published address


def test_a_wildcard_bind_address_is_never_published(tmp_path, ck):
    mem = tmp_path / "m"
    make_part(mem, 0, 1, 5)
    side = PeerSide(mem, ck, None, "0.0.0.0", Events().emit, print, interval_s=3600,
                    rdzv_host="127.0.0.1")
    side.start(RUN)
    try:
        (entry,) = registry.live_nodes(ck, RUN, time.time())
        assert entry.host == "127.0.0.1"  # the address that reaches the rendezvous
        listing = list_remote((entry.host, entry.port), RUN, None,
                              secret=registry.run_secret(ck, RUN))
        assert len(listing) == 1
    finally:
        side.close()


def test_published_host(monkeypatch):
    assert published_host("10.1.2.3", "10.0.0.1") == "10.1.2.3"
    assert published_host("node7.cluster", None) == "node7.cluster"
    assert published_host("0.0.0.0", "127.0.0.1") == "127.0.0.1"
    assert published_host("::", "127.0.0.1") == "127.0.0.1"
    # No rendezvous and a host name that resolves to nothing: refused, with what to set.
    monkeypatch.setattr(peerside.socket, "gethostname", lambda: "no-such-host.invalid")
    with pytest.raises(PeersOff, match="set RTRAIN_PEER_HOST") as e:
        published_host("0.0.0.0", None)
    assert "\n" not in str(e.value)
