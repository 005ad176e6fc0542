"""Encryption benchmark: the Checkpointer's save of the same state with and without a key.

    python scripts/bench_encrypt.py [--gib 1.0] [--repeat 5] [--dir bench-out]

Prints, for a state of about --gib GiB (float32 weights), the sync save time of
`Checkpointer.save` (same path, same checkpoint dir layout, fsync on) unencrypted and with
RTRAIN_ENCRYPTION_KEY's AES-256-GCM (checkpoint/encrypted_file.py), median and best of --repeat
runs, and the ratio of their throughputs (target: encrypted >= 0.7x unencrypted). Also the
restore of each, from page cache (every byte hashed; the encrypted one also authenticated and
decrypted).
Rounds alternate the order so drift in disk speed hits both alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from bench_checkpoint import build, state_bytes

import rtrain

KEY = "0f" * 32  # a raw 32-byte key: no passphrase stretching in the timings


def save(model: torch.nn.Module, d: Path, key: str | None) -> float:
    shutil.rmtree(d, ignore_errors=True)
    ck = rtrain.Checkpointer(model=model, ckpt_dir=d, keep=1, encryption_key=key)
    os.sync()
    t0 = time.perf_counter()
    ck.save(1)
    return time.perf_counter() - t0


def restore(model: torch.nn.Module, d: Path, key: str | None) -> float:
    ck = rtrain.Checkpointer(model=model, ckpt_dir=d, encryption_key=key,
                             restoring=rtrain.Restoring(verify="quick"))
    t0 = time.perf_counter()
    ck.restore(d / "checkpoint-1")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default="bench-out")
    args = ap.parse_args()
    for k in ("RTRAIN_RUN_DIR", "RTRAIN_RESUME_FROM", "RTRAIN_SIGNING_KEY",
              "RTRAIN_ENCRYPTION_KEY", "RTRAIN_ENCRYPTION_KEY_FILE"):
        os.environ.pop(k, None)
    root = Path(args.dir).resolve() / "encrypt"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model = build(args.gib)
    nbytes = state_bytes(model)
    methods = [("plain", None), ("encrypted", KEY)]
    saves: dict[str, list[float]] = {m: [] for m, _ in methods}
    save(model, root / "warm", KEY)  # imports, allocator and page cache warm
    shutil.rmtree(root / "warm")
    for i in range(args.repeat):
        for name, key in methods[i % 2:] + methods[:i % 2]:
            saves[name].append(save(model, root / name, key))
    twin = build(args.gib)
    loads: dict[str, list[float]] = {m: [] for m, _ in methods}
    for name, key in methods:
        restore(twin, root / name, key)  # page cache warm
    for i in range(args.repeat):
        for name, key in methods[i % 2:] + methods[:i % 2]:
            loads[name].append(restore(twin, root / name, key))
    if os.environ.get("BENCH_VERBOSE"):
        print({k: [round(x, 3) for x in v] for k, v in (saves | {
            f"load {k}": v for k, v in loads.items()}).items()})
    gb = nbytes / 1e9
    print(f"state: {nbytes / 2**30:.2f} GiB, {args.repeat} runs each; median and best run "
          f"(on a shared machine the best is the one least disturbed); {os.cpu_count()} cores")
    print(f"{'measure':<36}{'median s':>9}{'GB/s':>7}{'ratio':>7}{'best s':>8}{'ratio':>7}"
          "  target")
    rows = [("save, unencrypted", saves["plain"], None, ""),
            ("save, encrypted (AES-256-GCM)", saves["encrypted"], saves["plain"], ">= 0.70x"),
            ("restore, unencrypted (page cache)", loads["plain"], None, ""),
            ("restore, encrypted (page cache)", loads["encrypted"], loads["plain"], "")]
    for label, times, base, target in rows:
        med, best = statistics.median(times), min(times)
        r_med = "" if base is None else f"{statistics.median(base) / med:.2f}x"
        r_best = "" if base is None else f"{min(base) / best:.2f}x"
        print(f"{label:<36}{med:>9.3f}{gb / med:>7.2f}{r_med:>7}{best:>8.3f}{r_best:>7}"
              f"  {target}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
