"""A real Lightning run that knows nothing of rtrain: a tiny regression model, ModelCheckpoint
every N steps (`epoch=E-step=S.ckpt`), batch size and accumulation from argv, `--ckpt_path` to
resume. Test faults as in hf_train.py: --kill_at STEP (once), --oom_above N from --oom_from STEP.
"""

import argparse
import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt_dir", required=True)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--accumulate_grad_batches", type=int, default=1)
    p.add_argument("--ckpt_path", default=None)
    p.add_argument("--max_steps", type=int, default=16)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--kill_at", type=int, default=0)
    p.add_argument("--oom_above", type=int, default=0)
    p.add_argument("--oom_from", type=int, default=0)
    return p.parse_args()


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Faults(pl.Callback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        a = self.args
        if a.oom_above and trainer.global_step >= a.oom_from and a.batch_size > a.oom_above:
            print(f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
                  f"(batch {a.batch_size}; injected)", file=sys.stderr, flush=True)
            os._exit(1)

    def on_train_start(self, trainer, module):
        # The checkpoint is restored by now: the next optimizer step is global_step + 1.
        print(f"first step {trainer.global_step + 1} batch {self.args.batch_size} "
              f"accum {self.args.accumulate_grad_batches}", flush=True)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        marker = os.path.join(self.args.ckpt_dir, ".killed")
        if trainer.global_step == self.args.kill_at and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"killing myself at step {trainer.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    a = parse_args()
    os.makedirs(a.ckpt_dir, exist_ok=True)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=a.batch_size)
    every = pl.callbacks.ModelCheckpoint(dirpath=a.ckpt_dir, filename="{epoch}-{step}",
                                         every_n_train_steps=a.every, save_top_k=-1)
    trainer = pl.Trainer(max_steps=a.max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=a.accumulate_grad_batches,
                         callbacks=[Faults(a), every])
    trainer.fit(Model(), data, ckpt_path=a.ckpt_path)
    print(f"done at global_step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
