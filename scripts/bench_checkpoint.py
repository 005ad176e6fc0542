"""Checkpoint benchmark: rtrain's save/verify against baselines measured in the same run.

    python scripts/bench_checkpoint.py [--gib 1.0] [--repeat 3] [--load-repeat 9] [--dir bench-out]

Prints, for a state of about --gib GiB (float32 weights):
  sync save     vs a raw sequential write of the same bytes + fsync   (target >= 0.9x)
  sync save     vs torch.save + fsync of the same state dict          (target >= 1.0x)
  async save    training-thread blocked time vs the sync save time    (target <= 0.15x)
  verify full   throughput from page cache                            (target >= 2 GB/s)
                unsigned (xxh3-128 file hashes) and signed (blake3 file hashes)
  restore       load into a model, every byte hashed as it is read, both hash algorithms,
                vs safetensors load_file + copy (unverified), taken in turn  (target <= 1.5x)
Medians over --repeat runs; runs alternate so drift in disk speed hits every method alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import rtrain
from rtrain.checkpoint.verify import verify


def build(gib: float) -> nn.Module:
    n_layers = 8
    per_layer = int(gib * (1 << 30) / 4 / n_layers)
    side = int(per_layer ** 0.5)
    torch.manual_seed(0)
    with torch.no_grad():
        model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(n_layers)])
        for p in model.parameters():
            p.uniform_(-1, 1)
    return model


def state_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def raw_write(model: nn.Module, path: Path) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in model.state_dict().values():
            os.write(fd, t.reshape(-1).view(torch.uint8).numpy())
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def torch_save(model: nn.Module, path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(model.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def rtrain_sync(model: nn.Module, d: Path) -> float:
    ck = rtrain.Checkpointer(model=model, ckpt_dir=d, keep=1)
    t0 = time.perf_counter()
    ck.save(1)
    return time.perf_counter() - t0


def rtrain_async(model: nn.Module, d: Path, ck: rtrain.Checkpointer, step: int) -> float:
    t0 = time.perf_counter()
    ck.save(step)
    blocked = time.perf_counter() - t0
    ck.close()
    return blocked


def verify_speed(ckpt: Path, key: bytes | None, repeat: int) -> float:
    """Median seconds of a full verification, from page cache."""
    assert verify(ckpt, "full", key).ok  # warms the page cache
    vt = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert verify(ckpt, "full", key).ok
        vt.append(time.perf_counter() - t0)
    return statistics.median(vt)


def load_speeds(model: nn.Module, ckpt: Path, signed: Path, key: bytes, repeat: int
                ) -> dict[str, float]:
    """Median seconds of each way of loading `model` from page cache, taken in turn each round
    (the order rotating) so that load on the machine hits every method alike:
    - plain: what restore did before it hashed while reading, safetensors' load_file (mmap,
      nothing verified) and a copy into the model;
    - restore / restore_signed: Checkpointer.restore at the quick level (as under rtrain, which
      verified fully already), hashing every byte it reads (xxh3-128 / blake3)."""
    from safetensors.torch import load_file

    def plain() -> None:
        tensors = load_file(ckpt / "model.safetensors")
        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(tensors[name])

    def restorer(path: Path, k: bytes | None):
        ck = rtrain.Checkpointer(model=model, ckpt_dir=path.parent, signing_key=k,
                                 restoring=rtrain.Restoring(verify="quick"))
        return lambda: ck.restore(path)

    methods = [("plain", plain), ("restore", restorer(ckpt, None)),
               ("restore_signed", restorer(signed, key))]
    times: dict[str, list[float]] = {name: [] for name, _ in methods}
    for _, fn in methods:
        fn()  # page cache and allocator warm
    for i in range(repeat):
        for name, fn in methods[i % 3:] + methods[:i % 3]:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    if os.environ.get("BENCH_VERBOSE"):
        print({k: [round(x, 3) for x in v] for k, v in times.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--dir", default="bench-out")
    ap.add_argument("--load-repeat", type=int, default=0,
                    help="rounds of the load comparison (default: --repeat); loads are quick, "
                    "and more rounds steady their medians on a busy machine")
    args = ap.parse_args()
    for k in ("RTRAIN_RUN_DIR", "RTRAIN_RESUME_FROM", "RTRAIN_SIGNING_KEY"):
        os.environ.pop(k, None)
    root = Path(args.dir).resolve()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    model = build(args.gib)
    nbytes = state_bytes(model)
    times: dict[str, list[float]] = {"raw": [], "torch": [], "sync": [], "async": []}
    ck_async = rtrain.Checkpointer(model=model, ckpt_dir=root / "async", keep=1,
                                   saving=rtrain.Saving(async_mode="auto"))
    rtrain_async(model, root / "async", ck_async, 1)  # first call allocates the buffers
    def run_raw(i: int) -> float:
        t = raw_write(model, root / "raw.bin")
        (root / "raw.bin").unlink()
        return t

    def run_torch(i: int) -> float:
        t = torch_save(model, root / "torch.pt")
        (root / "torch.pt").unlink()
        return t

    def run_sync(i: int) -> float:
        shutil.rmtree(root / "sync", ignore_errors=True)
        return rtrain_sync(model, root / "sync")

    methods = [("raw", run_raw), ("torch", run_torch), ("sync", run_sync),
               ("async", lambda i: rtrain_async(model, root / "async", ck_async, i + 2))]
    for i in range(args.repeat):
        # Rotate the order each round: whichever runs first would otherwise always meet the
        # previous round's deletions and write-back.
        for name, fn in methods[i % 4:] + methods[:i % 4]:
            os.sync()
            times[name].append(fn(i))
    med = {k: statistics.median(v) for k, v in times.items()}
    if os.environ.get("BENCH_VERBOSE"):
        print({k: [round(x, 3) for x in v] for k, v in times.items()})
    ckpt = root / "sync" / "checkpoint-1"
    signer = rtrain.Checkpointer(model=model, ckpt_dir=root / "signed", keep=1,
                                 signing_key="bench")
    signed = signer.save(1)
    ver = verify_speed(ckpt, None, args.repeat)
    ver_signed = verify_speed(signed, signer.key, args.repeat)
    twin = build(args.gib)
    loads = load_speeds(twin, ckpt, signed, signer.key, args.load_repeat or args.repeat)
    plain, load, load_signed = loads["plain"], loads["restore"], loads["restore_signed"]
    gb = nbytes / 1e9
    print(f"state: {nbytes / 2**30:.2f} GiB, {args.repeat} runs each, medians; torch "
          f"{torch.__version__}, {os.cpu_count()} cores")
    print(f"{'measure':<42}{'time s':>8}{'GB/s':>8}{'ratio':>8}  target")
    rows = [
        ("raw write + fsync (baseline)", med["raw"], gb / med["raw"], None, ""),
        ("torch.save + fsync (baseline)", med["torch"], gb / med["torch"], None, ""),
        ("rtrain sync save vs raw", med["sync"], gb / med["sync"], med["raw"] / med["sync"],
         ">= 0.90x"),
        ("rtrain sync save vs torch.save", med["sync"], gb / med["sync"],
         med["torch"] / med["sync"], ">= 1.00x"),
        ("async save: blocked vs sync save", med["async"], None, med["async"] / med["sync"],
         "<= 0.15x"),
        ("verify full, xxh3-128 (unsigned)", ver, gb / ver, None, ">= 2 GB/s"),
        ("verify full, blake3 (signed)", ver_signed, gb / ver_signed, None, "baseline"),
        ("safetensors load_file + copy_ (baseline)", plain, gb / plain, None, ""),
        ("restore, hashing xxh3-128 (vs baseline)", load, gb / load, load / plain,
         "<= 1.5x"),
        ("restore, hashing blake3 (vs baseline)", load_signed, gb / load_signed,
         load_signed / plain, ""),
    ]
    for name, t, rate, ratio, target in rows:
        rate_s = f"{rate:8.2f}" if rate else " " * 8
        ratio_s = f"{ratio:7.2f}x" if ratio else " " * 8
        print(f"{name:<42}{t:8.3f}{rate_s}{ratio_s}  {target}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
