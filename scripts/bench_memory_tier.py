"""Memory-tier benchmark: the training thread's stall per snapshot against today's async disk
save, and a restore from memory against one from disk, measured in the same run; with
--step-overhead, what a snapshot every step costs a training step.

    python scripts/bench_memory_tier.py [--gib 1.0] [--rounds 5] [--dir bench-out]
    python scripts/bench_memory_tier.py --step-overhead [--rounds 6] [--steps 6] [--batch 160]

A model of 8 linear layers with Adam, whose weights and optimizer state together are about
--gib GiB, trains on CPU; rounds alternate between
  snapshot    `Saving(memory=1)`: the time `maybe_save` blocks, plus the optimizer step's wait
              for the copy (the tier's own `stall_s`)                    (target <= 0.1 s and
                                                                          <= 0.1x the async save)
  async save  `Saving(async_mode="auto")` (a forked writer): the time `save` blocks
and each is followed by one training step, timed against a step with neither (what the copy in
the background, or the copy-on-write faults after a fork, cost the step that follows).
Then the restore of the same checkpoint, taken in turn (medians of --rounds):
  from memory   the snapshot in /dev/shm, as a relaunch reads it           (target <= 0.3x)
  from disk     its persisted copy in --dir, from page cache, and cold (its pages dropped
                with posix_fadvise first, as after a reboot or on another node)

--step-overhead: an MLP of 10.5M parameters (512 -> 2048 -> 2048 -> 2048 -> 512) with AdamW
trains on CPU in rounds of --steps steps that alternate between no snapshot,
`Saving(memory=1)` (a snapshot at every step boundary) and the default (`memory=` left out:
the interval "auto" chooses); the time of a loop iteration (forward, backward, optimizer step,
`maybe_save`) is timed. Prints the median step of each, their ratios to the first (target <=
1.05x), the default's interval and cost, and where a snapshot's time went (the tier's timers).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR, ENV_RESUME_FROM

SHM = Path(tempfile.mkdtemp(prefix="rtrain-bench-", dir="/dev/shm"))
os.environ[ENV_MEMORY_DIR] = str(SHM)

import rtrain  # noqa: E402  (after the memory dir is set: the tier reads it at construction)
from rtrain.checkpoint.layout import list_checkpoints  # noqa: E402
from rtrain.supervisor.memtier.persist import persist  # noqa: E402
from rtrain.supervisor.memtier.shmdir import newest  # noqa: E402


def build(gib: float) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """Weights + Adam's two moments = 3 x the weights: about `gib` GiB in all."""
    n_layers = 8
    side = int((gib * (1 << 30) / 4 / 3 / n_layers) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(n_layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, side


def train_step(model: nn.Module, opt: torch.optim.Optimizer, side: int) -> float:
    t0 = time.perf_counter()
    loss = model(torch.randn(4, side)).pow(2).mean()
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def drop_pages(path: Path) -> None:
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_restore(model: nn.Module, opt: torch.optim.Optimizer, side: int, path: Path,
                  ckpt_dir: Path) -> tuple[float, float]:
    """The restore as a relaunch runs it (RTRAIN_RESUME_FROM), and it with the first step after
    it (a snapshot's pages are mapped, so the first writes to them copy them: counted there)."""
    os.environ[ENV_RESUME_FROM] = str(path)
    try:
        ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=ckpt_dir)
        t0 = time.perf_counter()
        ck.restore()
        restored = time.perf_counter() - t0
        train_step(model, opt, side)
        return restored, time.perf_counter() - t0
    finally:
        del os.environ[ENV_RESUME_FROM]


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The issue's job: an MLP of 10.5M parameters with AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_overhead(args: argparse.Namespace, out: Path) -> None:
    """Rounds of --steps loop iterations, alternating between no snapshot and one every step;
    the first iteration of each round is left out (it follows the other kind's last)."""
    model, opt = mlp()
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, 512)
    ckpts = {
        "none": rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=out / "plain",
                                    saving=rtrain.Saving(on_failure=False, memory=None)),
        "memory=1": rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=out / "mem",
                                        saving=rtrain.Saving(on_failure=False, memory=1)),
        # Left out: the tier on by default, at the interval "auto" chooses.
        "default": rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=out / "default",
                                       saving=rtrain.Saving(on_failure=False))}
    tier = ckpts["memory=1"]._memory
    assert tier is not None and ckpts["default"]._memory is not None
    kinds = list(ckpts)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    timers: dict[str, list[float]] = {}
    step = 0
    for r in range(len(kinds) * (args.rounds + 1)):  # a round of each to warm up
        kind = kinds[r % len(kinds)]
        ckpt = ckpts[kind]
        for i in range(args.steps + 1):
            t0 = time.perf_counter()
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            step += 1
            ckpt.maybe_save(step)
            took = time.perf_counter() - t0
            if r >= len(kinds) and i > 0:
                times[kind].append(took)
                if kind == "memory=1":
                    for name, value in _tier_timers(tier).items():
                        timers.setdefault(name, []).append(value)
        tier.wait()
    auto = ckpts["default"]._memory
    for c in ckpts.values():
        c.close()
    med = statistics.median
    base = med(times["none"])
    q = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
    print(f"MLP {n / 1e6:.1f}M parameters, AdamW, batch {args.batch}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; {args.rounds} rounds of {args.steps} steps each")
    for kind, v in times.items():
        print(f"  step, {kind:>8}: median {med(v) * 1e3:.1f} ms (quartiles "
              f"{q[kind][0] * 1e3:.1f}-{q[kind][2] * 1e3:.1f}, n={len(v)})")
    for kind in kinds[1:]:
        snap = med(times[kind])
        print(f"overhead of {kind}: {snap / base:.3f}x ({(snap - base) * 1e3:+.1f} ms a step; "
              "target <= 1.05x)")
    print(f"memory=1: {tier.abandoned} snapshots abandoned by the optimizer step; default: "
          f"every {auto.every} steps, cost {(auto.cost_s or 0) * 1e3:.1f} ms a snapshot, "
          f"{auto.abandoned} abandoned")
    print("a snapshot's time (the tier's timers, medians): " + ", ".join(
        f"{k} {med(v) * 1e3:.2f} ms" for k, v in timers.items()))


def _tier_timers(tier) -> dict[str, float]:
    """What the tier measured for the newest snapshot that finished."""
    names = ("stall_s", "gate_s", "write_s", "writer_cpu_s", "copy_s", "hash_s")
    return {n[:-2]: getattr(tier, n) for n in names if getattr(tier, n, None) is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default="bench-out")
    ap.add_argument("--step-overhead", action="store_true",
                    help="time training steps with a snapshot every step against none")
    ap.add_argument("--steps", type=int, default=6, help="steps a round (--step-overhead)")
    ap.add_argument("--batch", type=int, default=160, help="batch size (--step-overhead)")
    args = ap.parse_args()
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    if args.step_overhead:
        step_overhead(args, out)
        shutil.rmtree(out, ignore_errors=True)
        return
    model, opt, side = build(args.gib)
    for _ in range(2):  # Adam's state exists, the allocator is warm
        train_step(model, opt, side)
    nbytes = state_bytes(model, opt)
    print(f"state: {nbytes / 2**30:.2f} GiB (weights {side}x{side} x 8, Adam), "
          f"torch {torch.__version__}, {os.cpu_count()} cores")

    mem = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=out / "unused",
                              saving=rtrain.Saving(memory=1))
    disk = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=out / "disk", keep=1,
                               saving=rtrain.Saving(async_mode="auto", memory=None))
    plain, snap_stall, snap_block, snap_next, save_stall, save_next = [], [], [], [], [], []
    step = 2
    for _ in range(args.rounds):
        plain.append(train_step(model, opt, side))
        step += 1
        t0 = time.perf_counter()
        mem.maybe_save(step)
        snap_block.append(time.perf_counter() - t0)
        snap_next.append(train_step(model, opt, side))
        mem._memory.wait()
        snap_stall.append(mem._memory.stall_s)
        step += 1
        t0 = time.perf_counter()
        disk.save(step)
        save_stall.append(time.perf_counter() - t0)
        save_next.append(train_step(model, opt, side))
        disk._bg.wait()
    mem.close()
    disk.close()

    med = statistics.median
    p_s = med(plain)
    print(f"\ntraining step alone: {p_s:.3f} s (median of {args.rounds})")
    print(f"snapshot: blocked in maybe_save {med(snap_block) * 1e3:.1f} ms; stall with the "
          f"optimizer's wait {med(snap_stall) * 1e3:.1f} ms; the next step "
          f"{med(snap_next):.3f} s ({med(snap_next) / p_s:.2f}x)")
    print(f"async disk save: blocked in save {med(save_stall) * 1e3:.1f} ms; the next step "
          f"{med(save_next):.3f} s ({med(save_next) / p_s:.2f}x)")
    ratio = med(snap_stall) / med(save_stall)
    print(f"snapshot stall vs async save stall: {ratio:.2f}x (target <= 0.1x, and <= 0.1 s)")

    snap, _ = newest(SHM, None)
    assert snap is not None
    persisted = persist(snap, out / "persisted").path
    runs: dict[str, list[tuple[float, float]]] = {"memory": [], "warm": [], "cold": []}
    for _ in range(args.rounds):
        runs["memory"].append(timed_restore(model, opt, side, snap.path, out / "unused"))
        runs["warm"].append(timed_restore(model, opt, side, persisted, out / "persisted"))
        drop_pages(persisted)
        runs["cold"].append(timed_restore(model, opt, side, persisted, out / "persisted"))
    for i, what in enumerate(("restore", "restore + first step")):
        m, w, c = (med(r[i] for r in runs[k]) for k in ("memory", "warm", "cold"))
        print(f"{what}: from memory {m:.3f} s; from disk, page cache {w:.3f} s ({m / w:.2f}x), "
              f"cold {c:.3f} s ({m / c:.2f}x)" + (" (target <= 0.3x)" if i == 0 else ""))
    assert [s for s, _ in list_checkpoints(out / "persisted")]
    shutil.rmtree(SHM, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutil.rmtree(SHM, ignore_errors=True)
