"""Peer copy benchmark: how fast one node copies a memory-tier part from another's server.

    python scripts/bench_memtier_peer.py [--mib 512] [--rounds 3] [--signed] [--root /dev/shm]

A part of about --mib MiB (two tensor files, as a rank writes one) is committed into a memory
dir under --root; a `PeerServer` serves it on 127.0.0.1 and `fetch_part` copies it into a
second memory dir, each file hashed as received (xxh3-128, or blake3 with --signed). Printed:
the listing's time and each copy's seconds and MiB/s (median of --rounds), and its ratio to a
baseline measured in the same run: the same files sent over a plain loopback TCP connection
into the same filesystem (sendfile, no protocol, no hashing). Loopback measures the protocol
and hashing, not a network: between nodes the link's rate is the ceiling.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from rtrain.checkpoint import hashing, parts, runid
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.layout import checkpoint_name
from rtrain.checkpoint.safetensors_io import TensorBlob
from rtrain.supervisor.memtier.peerfetch import fetch_part, list_remote
from rtrain.supervisor.memtier.peerserver import PeerServer


def make_part(memory_dir: Path, mib: int, run: str, key: bytes | None) -> None:
    d = parts.rank_dir(memory_dir, 0)
    d.mkdir(parents=True)
    runid.write(d, run)
    pending = PendingCheckpoint(d, 100, fsync=False, hash_alg=hashing.alg_for(key))
    rng = np.random.default_rng(0)
    for name, share in (("model.safetensors", 0.25), ("optimizer.safetensors", 0.75)):
        a = rng.standard_normal(int(mib * share * (1 << 20)) // 4).astype(np.float32)
        pending.write_tensors(name, [TensorBlob("t", "F32", a.shape, memoryview(a))])
    pending.commit({"epoch": 0, "samples_seen": 0,
                    "info": {"memory_snapshot": True, **parts.part_fields(0, 1)}}, key)


def raw_copy(files: list[Path], dest: Path) -> float:
    """The baseline: each file sent over one loopback TCP connection (sendfile) and written
    into `dest`; seconds."""
    dest.mkdir(parents=True)
    listener = socket.create_server(("127.0.0.1", 0))

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            for f in files:
                with open(f, "rb") as src:
                    conn.sendfile(src)

    sender = threading.Thread(target=send)
    t = time.perf_counter()
    sender.start()
    with socket.create_connection(listener.getsockname()) as sock:
        buf = bytearray(1 << 20)
        for f in files:
            left = f.stat().st_size
            with open(dest / f.name, "wb") as out:
                while left:
                    n = sock.recv_into(buf, min(left, len(buf)))
                    out.write(memoryview(buf)[:n])
                    left -= n
    sender.join()
    elapsed = time.perf_counter() - t
    listener.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--signed", action="store_true")
    ap.add_argument("--root", default="/dev/shm")
    args = ap.parse_args()
    key = hashing.derive_key(b"bench") if args.signed else None
    run = runid.new()
    root = Path(tempfile.mkdtemp(prefix="rtrain-peer-bench-", dir=args.root))
    try:
        make_part(root / "a", args.mib, run, key)
        server = PeerServer(root / "a", run, key)
        server.start()
        try:
            t = time.perf_counter()
            (part,) = list_remote(server.address, run, key)
            listed = time.perf_counter() - t
            times, raw = [], []
            files = [p for p in sorted((parts.rank_dir(root / "a", 0) /
                                        checkpoint_name(part.step)).iterdir()) if p.is_file()]
            for i in range(args.rounds):
                raw.append(raw_copy(files, root / f"raw{i}"))
                shutil.rmtree(root / f"raw{i}")
                dest = parts.rank_dir(root / f"b{i}", 0, held=True) / checkpoint_name(part.step)
                t = time.perf_counter()
                fetch_part(server.address, part, dest, run, key)
                times.append(time.perf_counter() - t)
                shutil.rmtree(root / f"b{i}")
        finally:
            server.close()
        s, r = statistics.median(times), statistics.median(raw)
        mib = part.bytes / (1 << 20)
        print(f"list {listed * 1000:.1f} ms; copy of {mib:.0f} MiB "
              f"({'blake3, signed' if key else 'xxh3-128'}): median {s:.2f} s, "
              f"{mib / s:.0f} MiB/s (rounds: {', '.join(f'{x:.2f}' for x in times)} s); "
              f"plain TCP copy {r:.2f} s: {s / r:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
