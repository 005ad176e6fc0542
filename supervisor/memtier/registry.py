"""How the nodes of a multi-node run find each other's peer servers: files in the checkpoint dir.

Every node of a multi-node run writes the same checkpoint dir (a shared filesystem), so that is
where each node's rtrain says where its peer server listens:

    <ckpt-dir>/.rtrain-peers/<node>.json    {"v": 1, "node", "host", "port", "run", "updated"}

`register` rewrites the file atomically (a reader sees the old entry or the new, never half)
and is called again every few seconds: `updated` is the writer's unix time, and an entry not
refreshed within `STALE_S` is a node that is gone (a node lost whole cannot remove its own
file). This compares clocks of different machines, so it assumes they agree within seconds
(NTP), as the rest of a multi-node run does.

Each node copies the parts of its ring predecessor (`source_of`: the nodes sorted by id, each
taking the one before it, the first the last), so every node's parts are held by exactly one
other node while the ring is whole, and a node that joins or leaves changes the sources of its
neighbours only.

The files are data anyone who can write the checkpoint dir may have written: read with a size
limit and bounded parsing, and an entry that does not parse or check is ignored, not fatal.
The peer's handshake (`peerwire.py`) is what proves a node belongs to the run.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.checkpoint import runid, safeio
from rtrain.supervisor.core import atomic_write, filemode

REGISTRY = ".rtrain-peers"
STALE_S = 30.0
VERSION = 1
_MAX_BYTES = 64 << 10
_NODE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_SUFFIX = ".json"


@dataclass(frozen=True)
class Node:
    node: str
    """Unique per launch (`node_id`); the registry file's name."""
    host: str
    """Where its peer server listens: an address the other nodes can reach."""
    port: int
    run: str | None
    updated: float
    """Unix time of its last `register`."""


def node_id() -> str:
    """`<hostname>-<pid>-<4 hex>`: unique per launch, also for two launches on one host and a
    pid reused after a restart."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:150].lstrip(".-") or "host"
    return f"{host}-{os.getpid()}-{os.urandom(2).hex()}"


def _path(ckpt_dir: Path, node: str) -> Path:
    if not _NODE.fullmatch(node):
        raise ValueError(f"not a node id: {node!r:.80}")
    return Path(ckpt_dir) / REGISTRY / f"{node}{_SUFFIX}"


def register(ckpt_dir: Path, node: Node, *, now: float | None = None,
             mode: int = filemode.DEFAULT_FILE_MODE) -> None:
    """Publish (or refresh) `node`; its `updated` becomes `now` (default: the clock)."""
    entry = {"v": VERSION, "node": node.node, "host": node.host, "port": node.port,
             "run": node.run, "updated": time.time() if now is None else now}
    # Not durable: rewritten every few seconds, and stale anyway after a power cut.
    atomic_write.write_atomic(_path(ckpt_dir, node.node), json.dumps(entry) + "\n", mode=mode,
                              durable=False)


def unregister(ckpt_dir: Path, node: str) -> None:
    _path(ckpt_dir, node).unlink(missing_ok=True)


FORGET_S = 3600.0


def forget_stale(ckpt_dir: Path, now: float, older_s: float = FORGET_S) -> int:
    """Remove entries not refreshed for `older_s` (by the file's mtime): nodes lost whole,
    which cannot remove their own, would otherwise pile up over a long run's launches.
    Returns how many went."""
    gone = 0
    try:
        with os.scandir(Path(ckpt_dir) / REGISTRY) as entries:
            old = [e.path for e in entries
                   if e.name.endswith(_SUFFIX) and e.is_file(follow_symlinks=False)
                   and now - e.stat(follow_symlinks=False).st_mtime > older_s]
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for path in old:
        try:
            os.unlink(path)
            gone += 1
        except OSError:
            pass
    return gone


def live_nodes(ckpt_dir: Path, run: str | None, now: float) -> list[Node]:
    """The nodes of `run` refreshed within STALE_S of `now`, sorted by node id. Files that do
    not read or check are ignored."""
    try:
        with os.scandir(Path(ckpt_dir) / REGISTRY) as entries:
            names = [e.name for e in entries]
    except (FileNotFoundError, NotADirectoryError):
        return []
    nodes = []
    for name in names:
        stem = name.removesuffix(_SUFFIX)
        if stem == name or not _NODE.fullmatch(stem):
            continue  # atomic_write's temp files, and anything else
        node = _read(Path(ckpt_dir) / REGISTRY / name, stem)
        if node is not None and node.run == run and now - node.updated <= STALE_S:
            nodes.append(node)
    nodes.sort(key=lambda n: n.node)
    return nodes


def _read(path: Path, stem: str) -> Node | None:
    try:
        raw = safeio.read_limited(path, _MAX_BYTES)  # no link, FIFO or device followed
        entry = safeio.parse_json(raw)
    except (OSError, ValueError):
        return None
    return _as_node(entry, stem)


def _as_node(entry: Any, stem: str) -> Node | None:
    if not isinstance(entry, dict) or entry.get("v") != VERSION or entry.get("node") != stem:
        return None
    host, port, run, updated = (entry.get(k) for k in ("host", "port", "run", "updated"))
    if not isinstance(host, str) or not 0 < len(host) <= 255:
        return None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    if run is not None and not runid.valid(run):
        return None
    if not isinstance(updated, (int, float)) or isinstance(updated, bool) \
            or not math.isfinite(updated):
        return None
    return Node(stem, host, port, run, float(updated))


def source_of(nodes: list[Node], me: str) -> Node | None:
    """The node `me` copies from: its predecessor in the ring of `nodes` sorted by node id
    (the first node's is the last); never `me`; None when no other node is there. `me` need
    not be among `nodes` (not registered yet): its place in the order counts."""
    others = sorted((n for n in nodes if n.node != me), key=lambda n: n.node)
    if not others:
        return None
    before = [n for n in others if n.node < me]
    return before[-1] if before else others[-1]
