"""A real Hugging Face Trainer run that knows nothing of rtrain: a tiny GPT-2 built from a config
(no hub download), a small in-memory dataset, `save_steps`, and the usual flags from argv.

Test faults, each for a script that cannot use RTRAIN_FAULTS:
  --kill_at STEP     SIGKILL itself once at this global step (a marker file makes it once)
  --oom_above N      from --oom_from STEP on, print a CUDA out-of-memory error to stderr and exit 1
                     while per_device_train_batch_size > N (memory that grows with the run)
"""

import argparse
import os
import signal
import sys

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--max_steps", type=int, default=16)
    p.add_argument("--save_steps", type=int, default=4)
    p.add_argument("--kill_at", type=int, default=0)
    p.add_argument("--oom_above", type=int, default=0)
    p.add_argument("--oom_from", type=int, default=0)
    return p.parse_args()


class Faults(TrainerCallback):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.first = None

    def on_step_begin(self, targs, state, control, **kw):
        a = self.args
        if (a.oom_above and state.global_step >= a.oom_from
                and targs.per_device_train_batch_size > a.oom_above):
            print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB "
                  f"(batch {targs.per_device_train_batch_size}; injected)", file=sys.stderr,
                  flush=True)
            os._exit(1)

    def on_step_end(self, targs, state, control, **kw):
        if self.first is None:
            self.first = state.global_step
            print(f"first step {state.global_step} batch {targs.per_device_train_batch_size} "
                  f"accum {targs.gradient_accumulation_steps}", flush=True)
        marker = os.path.join(self.args.output_dir, ".killed")
        if state.global_step == self.args.kill_at and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"killing myself at step {state.global_step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    a = parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 64, (64, 8), generator=g)]
    targs = TrainingArguments(
        output_dir=a.output_dir, max_steps=a.max_steps, save_steps=a.save_steps,
        save_strategy="steps", per_device_train_batch_size=a.per_device_train_batch_size,
        gradient_accumulation_steps=a.gradient_accumulation_steps, logging_steps=1,
        report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True,
        learning_rate=1e-3)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Faults(a)])
    trainer.train(resume_from_checkpoint=a.resume_from_checkpoint)
    print(f"done at global_step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
