"""Stands in for a nanoGPT-style single-file train.py in the docs' commands: one out/ckpt.pt,
rewritten in place with torch.save every 100 of 400 iterations (`iter_num` in the dict), read
back when given --init_from=resume. tests/test_doc_commands.py copies it in as train.py; the
rewrites, tears and kills are tested in tests/test_foreign_inplace.py with
tests/children/inplace_ckpt.py."""

import argparse
import os

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--init_from", default="scratch")
    p.add_argument("--out_dir", default="out")
    p.add_argument("--max_iters", type=int, default=400)
    p.add_argument("--eval_interval", type=int, default=100)
    args = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    iter_num = 0
    path = os.path.join(args.out_dir, "ckpt.pt")
    if args.init_from == "resume":
        checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        iter_num = checkpoint["iter_num"]
        print(f"resuming from {path} at iter {iter_num}", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    while iter_num < args.max_iters:
        x = torch.randn(16, 8)
        loss = (model(x) - x.mean(1, keepdim=True)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        iter_num += 1
        if iter_num % args.eval_interval == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "iter_num": iter_num, "best_val_loss": loss.item()}, path)
            print(f"iter {iter_num}: loss {loss.item():.4f}, saved {path}", flush=True)


if __name__ == "__main__":
    main()
