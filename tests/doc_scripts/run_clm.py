"""Stands in for a Hugging Face Trainer script (run_clm.py) in the docs' commands: the same
flags, and `checkpoint-N/` dirs laid out as the Trainer writes them (weights, optimizer.pt and
scheduler.pt, config.json, trainer_state.json written last), every 100 of 400 steps of a tiny
model. tests/test_doc_commands.py copies it in as run_clm.py; the real Trainer is tested in
tests/test_foreign_launch.py with tests/children/hf_train.py."""

import argparse
import json
import os

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--save_steps", type=int, default=100)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if args.resume_from_checkpoint:
        src = args.resume_from_checkpoint
        model.load_state_dict(load_file(os.path.join(src, "model.safetensors")))
        opt.load_state_dict(torch.load(os.path.join(src, "optimizer.pt"), weights_only=True))
        with open(os.path.join(src, "trainer_state.json")) as f:
            step = json.load(f)["global_step"]
        print(f"resumed from {src} at step {step}", flush=True)
    while step < args.max_steps:
        for _ in range(args.gradient_accumulation_steps):
            x = torch.randn(args.per_device_train_batch_size, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % args.save_steps == 0:
            out = os.path.join(args.output_dir, f"checkpoint-{step}")
            os.makedirs(out, exist_ok=True)
            save_file(model.state_dict(), os.path.join(out, "model.safetensors"))
            torch.save(opt.state_dict(), os.path.join(out, "optimizer.pt"))
            torch.save({"last_epoch": step}, os.path.join(out, "scheduler.pt"))
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump({"model_type": "stand-in"}, f)
            with open(os.path.join(out, "trainer_state.json"), "w") as f:
                json.dump({"global_step": step, "max_steps": args.max_steps}, f)
            print(f"step {step} loss {loss.item():.4f}: saved {out}", flush=True)


if __name__ == "__main__":
    main()
