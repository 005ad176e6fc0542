"""Stands in for a Lightning script in the docs' commands: --ckpt-dir, --batch-size and
--ckpt_path as its flags, and `epoch=E-step=S.ckpt` files shaped as ModelCheckpoint writes them
(state_dict, optimizer_states, global_step, epoch) every 100 of 400 steps, 100 to an epoch.
tests/test_doc_commands.py copies it in as train.py; real Lightning runs are tested in
tests/test_foreign_launch.py with tests/children/lightning_train.py."""

import argparse
import os

import torch

STEPS_PER_EPOCH = 100


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--ckpt_path", default=None)
    p.add_argument("--max_steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if args.ckpt_path:
        saved = torch.load(args.ckpt_path, weights_only=True)
        model.load_state_dict(saved["state_dict"])
        opt.load_state_dict(saved["optimizer_states"][0])
        step = saved["global_step"]
        print(f"restored {args.ckpt_path} at step {step}", flush=True)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    while step < args.max_steps:
        x = torch.randn(args.batch_size, 8)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step % args.every == 0:
            epoch = (step - 1) // STEPS_PER_EPOCH
            path = os.path.join(args.ckpt_dir, f"epoch={epoch}-step={step}.ckpt")
            torch.save({"epoch": epoch, "global_step": step,
                        "pytorch-lightning_version": "2.4.0",
                        "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                        "lr_schedulers": []}, path)
            print(f"step {step} loss {loss.item():.4f}: saved {path}", flush=True)


if __name__ == "__main__":
    main()
