"""A script that knows nothing of rtrain, shaped like a popular single-file GPT trainer: one
`ckpt.pt` in --out_dir, rewritten in place with torch.save every --every iterations (no step in
its name, `iter_num` in the dict), read back from there with --init_from=resume.

Test faults, each once (recorded in OUT/faults_done), at the save of an iteration:
--faults "ITER:KIND,...", KIND one of
  kill   save, train on a moment (random, under one save interval), then SIGKILL itself
  empty  a kill as torch.save opens the file: ckpt.pt truncated to 0 bytes
  half   a kill half way through torch.save: ckpt.pt holds the first half of the new bytes
  evil   ckpt.pt replaced by a torch.save-shaped zip whose pickle calls os.system (it would
         create OUT/pwned), then SIGKILL
  dir    ckpt.pt replaced by a directory, then SIGKILL
The saves faulted to leave a bad file wait --settle_s first: the content before them stays on
disk that long.
Each start appends its first iteration to OUT/starts.txt; the end writes OUT/done.json.
`--lightning`: the file is `last.ckpt` in Lightning's layout (`state_dict`, `optimizer_states`,
`global_step`), as ModelCheckpoint(save_last=True) rewrites it.
`--imagenet`: the file is `checkpoint.pth.tar` as pytorch/examples imagenet/main.py writes it
(`epoch`, `state_dict`, `optimizer`), copied to `model_best.pth.tar` at the first save, and read
back from `--resume PATH`.
"""

import argparse
import io
import json
import os
import pickle
import random
import shutil
import signal
import time
import zipfile

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out_dir", required=True)
    p.add_argument("--init_from", default="scratch")
    p.add_argument("--max_iters", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--step_s", type=float, default=0.05)
    p.add_argument("--settle_s", type=float, default=2.5)
    p.add_argument("--faults", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lightning", action="store_true")
    p.add_argument("--imagenet", action="store_true")
    p.add_argument("--resume", default="")
    return p.parse_args()


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def evil_zip(path: str, marker: str) -> None:
    """What a malicious checkpoint looks like: torch.save's layout, a pickle with a reduce."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle.dumps({"iter_num": 10**6, "x": Evil(marker)},
                                                    protocol=2))
        z.writestr("archive/version", "3\n")


def fault(kind: str, path: str, ckpt: dict, out: str) -> None:
    if kind == "kill":
        torch.save(ckpt, path)
        time.sleep(random.random() * 0.5)
    elif kind in ("empty", "half"):
        buf = io.BytesIO()
        torch.save(ckpt, buf)
        data = buf.getvalue()
        with open(path, "wb") as f:  # torch.save(ckpt, path) truncates first, too
            if kind == "half":
                f.write(data[: len(data) // 2])
    elif kind == "evil":
        evil_zip(path, os.path.join(out, "pwned"))
    elif kind == "dir":
        os.unlink(path)
        os.mkdir(path)
        (open(os.path.join(path, "x"), "w")).close()
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    a = parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, "last.ckpt" if a.lightning
                        else "checkpoint.pth.tar" if a.imagenet else "ckpt.pt")
    done_file = os.path.join(a.out_dir, "faults_done")
    done = set()
    if os.path.exists(done_file):
        with open(done_file) as f:
            done = set(f.read().split())
    faults = dict(f.split(":") for f in a.faults.split(",") if f)
    random.seed(a.seed + len(done))
    torch.manual_seed(a.seed)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if a.resume:  # imagenet's --resume PATH
        ckpt = torch.load(a.resume, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        start = ckpt["epoch"]
    elif a.init_from == "resume":
        ckpt = torch.load(path, map_location="cpu")  # weights_only: the default
        if a.lightning:
            model.load_state_dict(ckpt["state_dict"])
            opt.load_state_dict(ckpt["optimizer_states"][0])
            start = ckpt["global_step"]
        else:
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            start = ckpt["iter_num"]
    with open(os.path.join(a.out_dir, "starts.txt"), "a") as f:
        f.write(f"{start}\n")
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    for it in range(start + 1, a.max_iters + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(a.step_s)
        if it % a.every:
            continue
        if a.imagenet:
            ckpt = {"epoch": it, "arch": "linear", "state_dict": model.state_dict(),
                    "best_acc1": 0.5, "optimizer": opt.state_dict()}
        elif a.lightning:
            ckpt = {"epoch": 0, "global_step": it, "state_dict": model.state_dict(),
                    "optimizer_states": [opt.state_dict()], "lr_schedulers": []}
        else:
            ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "iter_num": it, "config": vars(a)}
        kind = faults.get(str(it))
        if kind and f"{it}:{kind}" not in done:
            with open(done_file, "a") as f:
                f.write(f"{it}:{kind}\n")
            if kind != "kill":
                time.sleep(a.settle_s)
            fault(kind, path, ckpt, a.out_dir)
        torch.save(ckpt, path)  # in place, as the script this imitates does
        if a.imagenet and it == a.every:  # is_best: main.py's shutil.copyfile
            shutil.copyfile(path, os.path.join(a.out_dir, "model_best.pth.tar"))
    with open(os.path.join(a.out_dir, "done.json"), "w") as f:
        json.dump({"iter_num": a.max_iters, "loss": loss.item()}, f)


if __name__ == "__main__":
    main()
