"""The goodput benchmark's training job, one script for every tool (scripts/bench_goodput.py).

    python goodput_job.py MODE LOG CKPT_DIR --steps 160 --batch 160 --save-every 20

An MLP of 10.5M parameters (512 -> 2048 -> 2048 -> 2048 -> 512, as bench_memory_tier.py's
--step-overhead job) trains with AdamW on batches drawn from a generator seeded by the step, so a
run split by any number of kills ends in the same state, bit for bit, as an uninterrupted one
wherever the tool restores the whole state. MODE says how it saves and resumes:

  plain        no checkpoint at all: the fault-free baseline, run without a launcher
  rtrain       rtrain.Checkpointer(every=N) with the default Saving (whatever the defaults are)
  rtrain-mem   the same with Saving(memory=1): a memory-tier snapshot every step
  torchsave    torch.save every N steps (to a temporary file, then os.replace), resume from it
  dcp          torch.distributed.checkpoint.async_save every N steps into a directory a step;
               resume from the newest one whose metadata was written (DCP writes it last)
  dlrover      DLRover's Flash Checkpoint: into memory every step, to disk every N steps

LOG gets one line per event, appended with one write each (the benchmark reads it while the job
runs): `start PID TIME STEP INFO` when the loop is about to begin (STEP: the steps done before
it, 0 on a fresh start), `step N TIME` after each step, before its save (a kill during the save
leaves the step done but not saved, as it is), `done TIME SHA256` over the final parameters and
optimizer state.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
from torch import nn


def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 512))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, 512, generator=g), torch.randn(size, 512, generator=g)


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """The final state: every parameter and every optimizer tensor, in parameter order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
        for _, v in sorted(opt.state[p].items()):
            h.update(v.detach().reshape(-1).numpy().tobytes() if torch.is_tensor(v)
                     else repr(v).encode())
    return h.hexdigest()


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def __call__(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())  # one write: the reader never sees half


class Plain:
    """No saving, no resuming."""

    def __init__(self, model, opt, args) -> None:
        self.info = "-"

    def restore(self) -> int:
        return 0

    def save(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class Rtrain(Plain):
    def __init__(self, model, opt, args) -> None:
        import rtrain

        saving = rtrain.Saving(memory=1) if args.mode == "rtrain-mem" else None
        self.ck = rtrain.Checkpointer(model=model, optimizer=opt, every=args.save_every,
                                      saving=saving)
        # what the benchmark prints: whether the defaults turned the memory tier on
        self.info = "memory-tier=" + ("on" if getattr(self.ck, "_memory", None) else "off")

    def restore(self) -> int:
        return self.ck.restore()

    def save(self, step: int) -> None:
        self.ck.maybe_save(step)

    def close(self) -> None:
        self.ck.close()


class TorchSave(Plain):
    def __init__(self, model, opt, args) -> None:
        self.model, self.opt, self.every = model, opt, args.save_every
        self.path = Path(args.ckpt_dir) / "ckpt.pt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.info = "-"

    def restore(self) -> int:
        if not self.path.exists():
            return 0
        state = torch.load(self.path)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return state["step"]

    def save(self, step: int) -> None:
        if step % self.every:
            return
        tmp = self.path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "step": step}, tmp)
        os.replace(tmp, self.path)


class Dcp(Plain):
    def __init__(self, model, opt, args) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import state_dict as sd

        self.dcp, self.sd = dcp, sd
        self.model, self.opt, self.every = model, opt, args.save_every
        self.root = Path(args.ckpt_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending = None
        self.info = "-"

    def state(self) -> dict:
        model, optim = self.sd.get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim}

    def restore(self) -> int:
        done = sorted(int(d.name) for d in self.root.iterdir()
                      if d.name.isdigit() and (d / ".metadata").exists())
        if not done:
            return 0
        state = self.state()
        self.dcp.load(state, checkpoint_id=str(self.root / str(done[-1])))
        self.sd.set_state_dict(self.model, self.opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
        return done[-1]

    def save(self, step: int) -> None:
        if step % self.every:
            return
        if self.pending is not None:
            self.pending.result()  # one save in flight at a time, as DCP's examples do
        self.pending = self.dcp.async_save(self.state(),
                                           checkpoint_id=str(self.root / str(step)))

    def close(self) -> None:
        if self.pending is not None:
            self.pending.result()


class Dlrover(Plain):
    def __init__(self, model, opt, args) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.storage = StorageType
        self.model, self.opt, self.every = model, opt, args.save_every
        self.root = Path(args.ckpt_dir)
        self.ck = DdpCheckpointer(str(self.root))
        self.info = "-"

    def restore(self) -> int:
        state = self.ck.load_checkpoint()
        if not state or "model" not in state:
            return 0
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        return int(state["step"])

    def save(self, step: int) -> None:
        state = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "step": step}
        kind = self.storage.DISK if step % self.every == 0 else self.storage.MEMORY
        # the path its restore looks for: DIR/STEP/rank_0.pt (DLRover's full_ckpt_engine.py)
        path = self.root / str(step) / "rank_0.pt"
        self.ck.save_checkpoint(step, state, str(path), storage_type=kind)
    # no close: the launcher's agent persists the last disk save after the process exits


MODES = {"plain": Plain, "rtrain": Rtrain, "rtrain-mem": Rtrain, "torchsave": TorchSave,
         "dcp": Dcp, "dlrover": Dlrover}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=sorted(MODES))
    ap.add_argument("log")
    ap.add_argument("ckpt_dir")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--save-every", type=int, default=20)
    args = ap.parse_args()
    log = Log(args.log)
    model, opt = mlp()
    saver = MODES[args.mode](model, opt, args)
    step = saver.restore()
    log(f"start {os.getpid()} {time.time()!r} {step} {saver.info}")
    while step < args.steps:
        x, y = batch(step, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        log(f"step {step} {time.time()!r}")
        saver.save(step)
    saver.close()
    log(f"done {time.time()!r} {digest(model, opt)}")


if __name__ == "__main__":
    main()
