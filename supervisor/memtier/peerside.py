"""Peer copies of the memory tier under several nodes: this node's side (docs/architecture.md,
"Beyond one machine"; the wire: peerserver.py, peerwire.py).

Each node's rtrain serves its memory dir's parts (peerserver.py) and registers where in the
shared checkpoint dir (registry.py). A thread copies, continually, the newest parts of one
peer, the ring predecessor among the run's live nodes, into `held/` (`replicate_once`), and
keeps this node's own parts of that step beside them (hard links: no second copy), so that
after a node is lost whole its successor holds the step whole: the lost node's parts and its
own. At each attempt's start (`gather`), before the ranks start, the node copies from its
peers whatever it lacks of the newest step whole across them: a replacement node, which starts
with an empty memory dir, pulls the group's state from the survivors' memory, not from shared
storage. The ranks then agree on the step themselves (worker/memtier/memory_resume.py): a part that
failed to copy leaves its step incomplete, and the group resumes from an older one or the disk.

Everything a peer sends is checked as it arrives (size and hash of every file against the
manifest, the signature under the run's key, the run identity, the rank and step asked for);
what fails is refused with its reason and costs a tier, never the run. Nothing waits for a
peer longer than its socket timeout.

Peers authenticate each other with the run's secret (peerwire.py): the signing key, or without
one the per-run key the nodes share through an owner-only file in the checkpoint dir
(`registry.run_secret`). Where neither can be had (a link or another user's file planted in the
registry dir), the launch goes without peer copies and says why (`PeersOff`): there is no
unauthenticated peer port.
"""

from __future__ import annotations

import ipaddress
import os
import queue
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rtrain.checkpoint import parts
from rtrain.checkpoint.layout import checkpoint_name, tmp_name
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.core.ownfiles import RefusedFile
from rtrain.supervisor.core.protocol import MEMORY_DROPPED
from rtrain.supervisor.memtier import decide, peerfetch, registry
from rtrain.supervisor.memtier.peerserver import PeerServer
from rtrain.supervisor.memtier.persist import link_files

REFRESH_S = 5.0  # how often the registry entry is refreshed (registry.STALE_S is the limit)
ENV_PEER_HOST = "RTRAIN_PEER_HOST"
"""Several nodes with the memory tier: the address this node's rtrain serves its peers' copies
on (default: the address that reaches the rendezvous endpoint). A wildcard (0.0.0.0, ::) is
bound but never published: the other nodes are given the address that reaches the rendezvous
endpoint (or the host name's), and without one the launch goes without peer copies."""
ENV_PEER_PORT = "RTRAIN_PEER_PORT"
"""... and its port (default: a free port)."""


def serving_address(rdzv_host: str | None, env: dict[str, str] | None = None
                    ) -> tuple[str, int]:
    """Where this node serves its snapshots: RTRAIN_PEER_HOST / RTRAIN_PEER_PORT, else the
    address this machine reaches the rendezvous endpoint from (the network the ranks use), on
    a port the OS picks. Finding it sends nothing: a UDP socket's connect only routes."""
    env = os.environ if env is None else env
    port = _port(env.get(ENV_PEER_PORT) or "0")
    if env.get(ENV_PEER_HOST):
        return env[ENV_PEER_HOST], port
    if not rdzv_host:
        return "127.0.0.1", port
    try:
        family, _, _, _, addr = socket.getaddrinfo(rdzv_host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0], port
    except (OSError, UnicodeError):
        return socket.gethostname(), port


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ConfigError(f"{ENV_PEER_PORT}={text!r:.40} is not a port: set it to a free port "
                          "(1-65535), or unset it for one the system picks")
    return port


class PeersOff(Exception):
    """This launch cannot serve its peers safely; str() is the one line a person reads."""


def _route(to: str, family: int) -> str | None:
    """The address of this machine that reaches `to` (nothing is sent: a UDP connect only
    routes)."""
    try:
        fam, _, _, _, addr = socket.getaddrinfo(to, 9, family, socket.SOCK_DGRAM)[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except (OSError, UnicodeError, IndexError):
        return None


def _own_address(family: int) -> str | None:
    """An address the host name resolves to that is not loopback or a wildcard."""
    try:
        found = socket.getaddrinfo(socket.gethostname(), None, family, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    for *_, addr in found:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        if not (ip.is_loopback or ip.is_unspecified or ip.is_link_local):
            return addr[0]
    return None


def published_host(bound: str, rdzv_host: str | None) -> str:
    """What the registry tells the other nodes to connect to, for a server bound to `bound`:
    `bound` itself, except a wildcard (every address of this machine, which to another node
    means its own): then the address that reaches the rendezvous endpoint, else one the host
    name resolves to. PeersOff when there is none."""
    try:
        ip = ipaddress.ip_address(bound.split("%")[0])
    except ValueError:
        return bound  # a host name: the user's
    if not ip.is_unspecified:
        return bound
    # 0.0.0.0 serves IPv4 only; "::" both where the system can (peerserver.py binds it so).
    family = socket.AF_INET if ip.version == 4 else socket.AF_UNSPEC
    found = (_route(rdzv_host, family) if rdzv_host else None) or _own_address(family)
    if found is None:
        raise PeersOff(f"{ENV_PEER_HOST}={bound} means every address of this machine, and "
                       "rtrain found none the other nodes can reach to publish: set "
                       f"{ENV_PEER_HOST} to this node's address on the cluster network")
    return found


class PeerSide:
    """One launch's peer copies: server, registry entry, copying thread, gather at start."""

    def __init__(self, memory_dir: Path, ckpt_dir: Path, key: bytes | None, host: str,
                 emit: Callable[..., Any], say: Callable[[str], None], *,
                 interval_s: float = 0.2, port: int = 0, timeout_s: float = 5.0,
                 rdzv_host: str | None = None) -> None:
        self.memory_dir, self.ckpt_dir, self.key = memory_dir, ckpt_dir, key
        self.host, self.port, self.interval_s = host, port, interval_s
        self.rdzv_host = rdzv_host  # what a wildcard `host` publishes (`published_host`)
        self.secret: bytes | None = None  # the run's, once started (peerwire.py)
        self.publish: str | None = None
        self.timeout_s = timeout_s  # per socket operation: a silent peer costs at most this
        self.emit, self.say = emit, say
        self.run: str | None = None
        self.me = registry.node_id()
        self.attempt = 0
        self._server: PeerServer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # What the copying thread has to say, emitted on the loop's thread (`poll`): the
        # event log keeps one writer.
        self._notes: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._said: dict[str, str] = {}  # per peer: the last state told (said once each)
        self._registered = 0.0
        self._complete: set[int] = set()  # held steps copied whole, own parts kept beside

    # ------------------------------------------------------------------ lifecycle

    def start(self, run: str | None) -> None:
        """Serve and register (once per launch), and start copying from the ring predecessor.
        PeersOff when this launch cannot (nothing was served or registered then); OSError
        when the port cannot be bound."""
        if self._server is not None:
            return
        self.run = run
        try:
            self.publish = published_host(self.host, self.rdzv_host)
            self.secret = self.key if self.key is not None else \
                registry.run_secret(self.ckpt_dir, run)
            registry.forget_stale(self.ckpt_dir, time.time())
        except RefusedFile as e:
            raise PeersOff(str(e)) from None
        self._server = PeerServer(self.memory_dir, run, self.key, self.host, self.port,
                                  secret=self.secret)
        self._server.start()
        self._register()
        self._thread = threading.Thread(target=self._loop, name="rtrain-peer-copy", daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._server is not None

    def wanted(self, run: str | None) -> bool:
        """Whether to start before the worker said it snapshots: this node holds parts (an
        earlier attempt's), or a node of the run serves its own (a replacement joining a run
        whose ranks snapshot). A run without the memory tier opens no port."""
        if any(parts.list_parts(self.memory_dir, self.key)):
            return True
        try:
            return bool(registry.live_nodes(self.ckpt_dir, run, time.time()))
        except RefusedFile:
            return True  # `start` says why there are no peer copies

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._server is not None:
            self._server.close()
            self._server = None
            try:
                registry.unregister(self.ckpt_dir, self.me)
            except RefusedFile:
                pass  # planted since the start: the entry goes stale (STALE_S) instead

    @property
    def address(self) -> tuple[str, int] | None:
        return self._server.address if self._server is not None else None

    # ------------------------------------------------------------------ at an attempt's start

    def gather(self, attempt: int) -> int | None:
        """Copy what this node lacks of the newest step whole across it and its live peers;
        that step, else None (nothing newer to copy, or no step could be completed)."""
        self.attempt = attempt
        local = {(p.rank, p.step, p.world_size) for p in self._parts() if p.run == self.run}
        offers: dict[str, dict[tuple[int, int, int], peerfetch.RemotePart]] = {}
        nodes = {n.node: n for n in self._peers()}
        for name, node in nodes.items():
            try:
                listed = peerfetch.list_remote((node.host, node.port), self.run, self.key,
                                                secret=self.secret, timeout_s=self.timeout_s)
            except peerfetch.PeerError as e:
                self._failed(name, None, f"cannot list its snapshots: {e}")
                continue
            offers[name] = {(p.rank, p.step, p.world_size): p for p in listed}
        plan = decide.gather_plan(local, {n: set(o) for n, o in offers.items()})
        for step, size, lacking in plan:
            t0, copied, ranks = time.monotonic(), 0, []
            for rank, offering in sorted(lacking.items()):
                got = None
                for name in offering:
                    node = nodes[name]
                    try:
                        got = self._fetch((node.host, node.port), offers[name][(rank, step, size)])
                    except peerfetch.PeerError as e:
                        self._failed(name, step, f"rank {rank}'s part: {e}")
                        continue
                    break
                if got is None:
                    break
                copied, ranks = copied + got, [*ranks, rank]
            else:
                seconds = round(time.monotonic() - t0, 4)
                self.emit("peer_copy", attempt=attempt, state="gathered",
                          peer=",".join(sorted({n for r in ranks for n in lacking[r][:1]})),
                          step=step, ranks=ranks, bytes=copied, seconds=seconds, reason=None)
                self.say(f"attempt {attempt}: copied ranks {_ranks(ranks)} of the memory "
                         f"snapshot of step {step} from a peer node ({copied / 2**20:.1f} MiB "
                         f"in {seconds:.2f} s)")
                return step
        return None

    # ------------------------------------------------------------------ the copying thread

    def poll(self) -> None:
        """At each watch sample: the copying thread's news, as events."""
        while True:
            try:
                note = self._notes.get_nowait()
            except queue.Empty:
                return
            self.emit("peer_copy", attempt=self.attempt, **note)
            if note["state"] == "failed":
                self.say(f"attempt {self.attempt}: peer copy from {note['peer']}: "
                         f"{note['reason']}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if time.monotonic() - self._registered >= REFRESH_S:
                    self._register()
                self.replicate_once()
            except OSError as e:  # a full /dev/shm, a registry that cannot be written
                self._note("failed", "this node", None, f"{e.strerror or e}")

    def replicate_once(self) -> int | None:
        """Copy the source node's newest parts not held yet; the step copied, else None."""
        if (self.memory_dir / MEMORY_DROPPED).exists():
            return None  # rtrain dropped the tier (memory pressure): hold nothing more
        source = registry.source_of(self._live(), self.me)
        if source is None:
            return None
        addr = (source.host, source.port)
        step: int | None = None
        try:  # one connection: the listing and the copy, several times a second
            with peerfetch.Session(addr, self.run, self.key, secret=self.secret,
                                   timeout_s=self.timeout_s) as s:
                listed = [p for p in s.list() if p.origin == parts.OWN]
                here = self._parts()  # once a cycle: each part's manifest is read and checked
                held = {(p.rank, p.step) for p in here if p.origin == parts.KEPT}
                own = {p.step for p in here if p.origin == parts.OWN and p.run == self.run}
                todo = decide.next_copy([(p.rank, p.step) for p in listed], held, own)
                if todo is None:
                    return None
                step, ranks = todo
                self._keep_own(step, here)
                for p in listed:
                    if p.step == step and p.rank in ranks:
                        self._fetch(addr, p, s)
        except peerfetch.PeerError as e:
            what = "cannot list its snapshots" if step is None else f"step {step}"
            self._note("failed", source.node, step, f"{what}: {e}")
            return None
        self._complete.add(step)
        self._note("replicating", source.node, step, None, ranks=ranks)
        self._prune([p for p in here if p.origin == parts.KEPT], step)
        return step

    # ------------------------------------------------------------------ helpers

    def _fetch(self, addr: tuple[str, int], part: peerfetch.RemotePart,
               session: peerfetch.Session | None = None) -> int:
        dest = parts.rank_dir(self.memory_dir, part.rank, held=True) / checkpoint_name(part.step)
        dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if dest.exists():
            return 0
        peerfetch.fetch_part(addr, part, dest, self.run, self.key, secret=self.secret,
                             timeout_s=self.timeout_s, session=session)
        return part.bytes

    def _keep_own(self, step: int, here: list[parts.Part]) -> None:
        """This node's own parts of `step`, linked into `held/` beside the peer's copy: the
        worker removes its older parts as it goes on, and the step stays whole here."""
        for p in here:
            if p.origin != parts.OWN or p.step != step or p.run != self.run:
                continue
            dest = parts.rank_dir(self.memory_dir, p.rank, held=True) / checkpoint_name(step)
            if dest.exists():
                continue
            dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = dest.parent / tmp_name(step)
            try:
                link_files(p.path, tmp)
                os.rename(tmp, dest)
            except OSError:  # removed by the worker meanwhile: this step is not whole here
                shutil.rmtree(tmp, ignore_errors=True)

    def _prune(self, held: list[parts.Part], copied: int) -> None:
        """Held steps beyond those kept (`decide.held_to_drop`); `held` was listed before this
        cycle's copy of `copied`, which is the newest and is kept."""
        for step in decide.held_to_drop({p.step for p in held} | {copied}, self._complete):
            for p in held:
                if p.step == step:
                    shutil.rmtree(p.path, ignore_errors=True)

    def _parts(self, *origins: str) -> list[parts.Part]:
        return parts.list_parts(self.memory_dir, self.key,
                                origins=origins or (parts.OWN, parts.KEPT))

    def _live(self) -> list[registry.Node]:
        try:
            return registry.live_nodes(self.ckpt_dir, self.run, time.time(), self.secret)
        except RefusedFile as e:  # planted since the start: no peer is read through it
            self._note("failed", "this node", None, str(e))
            return []

    def _peers(self) -> list[registry.Node]:
        return [n for n in self._live() if n.node != self.me]

    def _register(self) -> None:
        assert self._server is not None and self.publish is not None
        port = self._server.address[1]
        registry.register(self.ckpt_dir, registry.Node(self.me, self.publish, port, self.run,
                                                       time.time()), secret=self.secret)
        self._registered = time.monotonic()

    def _note(self, state: str, peer: str, step: int | None, reason: str | None,
              ranks: list[int] | None = None) -> None:
        said = state if state == "replicating" else f"{state}: {reason}"
        if self._said.get(peer) == said:  # each change once, not every half second
            return
        self._said[peer] = said
        self._notes.put({"state": state, "peer": peer, "step": step, "ranks": ranks or [],
                         "bytes": None, "seconds": None, "reason": reason})

    def _failed(self, peer: str, step: int | None, reason: str) -> None:
        """On the loop's thread (gather): at once."""
        self.emit("peer_copy", attempt=self.attempt, state="failed", peer=peer, step=step,
                  ranks=[], bytes=None, seconds=None, reason=reason)
        self.say(f"attempt {self.attempt}: peer copy from {peer}: {reason}")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
