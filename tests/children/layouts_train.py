"""A script that knows nothing of rtrain and keeps its checkpoints in the layout of a popular
trainer, written the way that trainer writes them (`--layout`):

  imagenet     pytorch/examples imagenet/main.py: `checkpoint.pth.tar` rewritten in place with
               torch.save each epoch (`epoch` is the next one to run), `shutil.copyfile` to
               `model_best.pth.tar` when the metric is the best so far; `--resume PATH`.
  timm         timm's CheckpointSaver: `tmp.pth.tar` renamed to `last.pth.tar`, hard-linked to
               `checkpoint-<epoch>.pth.tar` (the best --max_history kept) and to
               `model_best.pth.tar`; `--resume PATH` (`epoch` is the one finished, version 2).
  deepspeed    engine.save_checkpoint: `global_step<N>/mp_rank_00_model_states.pt` and
               `zero_pp_rank_0_mp_rank_00_optim_states.pt`, then `latest` naming the tag;
               `--resume DIR` (the tag dir: load_checkpoint(dirname, tag=basename)).
  composer     Trainer(save_folder=...): `ep<E>-ba<B>-rank0.pt`, `latest-rank0.pt` a symlink to
               the newest; `--resume FILE` (load_path).
  dcp          torchtitan: `step-<N>/` written by torch.distributed.checkpoint.save (`.metadata`
               and `__0_0.distcp`); `--resume DIR`.
  accelerate   accelerate's examples/by_feature/checkpointing.py with the real library:
               `accelerator.save_state("step_<N>")`; `--resume DIR` (load_state, the step from
               the dir's name).

One save per "epoch" of --steps steps. --kill_after "1,2,3": SIGKILL itself right after those
saves (each once, recorded in OUT/faults_done). Each start appends the first epoch it runs to
OUT/starts.txt, and the end writes OUT/done.json.
The `save_*` functions are the layouts' writers; tests/test_foreign_layouts.py calls them too.
"""

import argparse
import json
import os
import shutil
import signal
import time

import torch


def model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


# ------------------------------------------------------------------ the layouts' writers


def save_imagenet(out, epoch, model, opt, *, is_best):
    """main.py's save_checkpoint(state, is_best, filename='checkpoint.pth.tar')."""
    state = {"epoch": epoch + 1, "arch": "linear", "state_dict": model.state_dict(),
             "best_acc1": 0.5, "optimizer": opt.state_dict(), "scheduler": {}}
    filename = os.path.join(out, "checkpoint.pth.tar")
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, os.path.join(out, "model_best.pth.tar"))


def _duplicate(src, dst):
    """timm's CheckpointSaver._duplicate: a hard link, else a copy."""
    if os.path.exists(dst):
        os.unlink(dst)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def save_timm(out, epoch, model, opt, *, metric, max_history=2):
    """CheckpointSaver.save_checkpoint(epoch, metric): lower metric is better here."""
    state = {"epoch": epoch, "arch": "linear", "state_dict": model.state_dict(),
             "optimizer": opt.state_dict(), "version": 2, "metric": metric}
    tmp, last = os.path.join(out, "tmp.pth.tar"), os.path.join(out, "last.pth.tar")
    torch.save(state, tmp)
    if os.path.exists(last):
        os.unlink(last)
    os.rename(tmp, last)
    history_file = os.path.join(out, "history.json")
    history = []
    if os.path.exists(history_file):
        with open(history_file) as f:
            history = json.load(f)
    if len(history) < max_history or metric < max(m for _, m in history):
        if len(history) >= max_history:
            worst = max(history, key=lambda h: h[1])
            history.remove(worst)
            os.unlink(os.path.join(out, f"checkpoint-{worst[0]}.pth.tar"))
        _duplicate(last, os.path.join(out, f"checkpoint-{epoch}.pth.tar"))
        history.append((epoch, metric))
        if metric <= min(m for _, m in history):
            _duplicate(last, os.path.join(out, "model_best.pth.tar"))
    with open(history_file, "w") as f:
        json.dump(history, f)


def save_deepspeed(out, step, model, opt):
    """engine.save_checkpoint(out, tag=f"global_step{step}") under ZeRO stage 1, one rank."""
    tag = f"global_step{step}"
    os.makedirs(os.path.join(out, tag), exist_ok=True)
    torch.save({"module": model.state_dict(), "buffer_names": [], "optimizer": None,
                "lr_scheduler": None, "global_steps": step, "global_samples": step * 8,
                "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1,
                "ds_version": "0.16.0"},
               os.path.join(out, tag, "mp_rank_00_model_states.pt"))
    torch.save({"optimizer_state_dict": opt.state_dict(), "ds_version": "0.16.0"},
               os.path.join(out, tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    with open(os.path.join(out, "latest"), "w") as fd:  # last, as DeepSpeed does
        fd.write(tag)


def save_composer(out, epoch, batch, model, opt):
    """Composer's CheckpointSaver: the rank's file, then the latest-rank0.pt symlink swapped."""
    name = f"ep{epoch}-ba{batch}-rank0.pt"
    torch.save({"state": {"model": model.state_dict(),
                          "optimizers": {"SGD": opt.state_dict()},
                          "timestamp": {"epoch": epoch, "batch": batch}},
                "rng": [{"torch": torch.get_rng_state()}]}, os.path.join(out, name))
    tmp = os.path.join(out, ".latest-rank0.pt.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, os.path.join(out, "latest-rank0.pt"))


def save_dcp(out, step, model, opt):
    """torchtitan's CheckpointManager: dcp.save of the state dict into step-<N>/."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
              "train_state": {"step": step}},
             checkpoint_id=os.path.join(out, f"step-{step}"))


# ------------------------------------------------------------------ resuming


def load_epoch(layout, path, model, opt):
    """The first epoch to run when resuming from `path`, loaded as each trainer loads it."""
    if layout == "imagenet":
        ckpt = torch.load(path, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        return ckpt["epoch"]
    if layout == "timm":
        ckpt = torch.load(path, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        opt.load_state_dict(ckpt["optimizer"])
        return ckpt["epoch"] + (1 if ckpt.get("version", 1) > 1 else 0)
    if layout == "deepspeed":
        load_dir, tag = os.path.split(path.rstrip("/"))
        states = torch.load(os.path.join(load_dir, tag, "mp_rank_00_model_states.pt"))
        optim = torch.load(os.path.join(load_dir, tag,
                                        "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        model.load_state_dict(states["module"])
        opt.load_state_dict(optim["optimizer_state_dict"])
        return states["global_steps"] + 1
    if layout == "composer":
        ckpt = torch.load(path, map_location="cpu")
        model.load_state_dict(ckpt["state"]["model"])
        opt.load_state_dict(ckpt["state"]["optimizers"]["SGD"])
        return ckpt["state"]["timestamp"]["epoch"] + 1
    if layout == "dcp":
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "train_state": {"step": 0}}
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        return state["train_state"]["step"] + 1
    raise SystemExit(f"unknown layout {layout}")


def main_accelerate(a, train):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, opt = model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    first = 1
    if a.resume:
        accelerator.load_state(a.resume)
        # As the example does: the step from the directory's name.
        first = int(os.path.basename(a.resume.rstrip("/")).replace("step_", "")) + 1
    record_start(a.out_dir, first)
    for epoch in range(first, a.epochs + 1):
        train(model, opt)
        accelerator.save_state(os.path.join(a.out_dir, f"step_{epoch}"))
        maybe_die(a, epoch)


def record_start(out, first):
    with open(os.path.join(out, "starts.txt"), "a") as f:
        f.write(f"{first}\n")


def maybe_die(a, epoch):
    done_file = os.path.join(a.out_dir, "faults_done")
    done = set()
    if os.path.exists(done_file):
        with open(done_file) as f:
            done = set(f.read().split())
    if str(epoch) in a.kill_after.split(",") and str(epoch) not in done:
        with open(done_file, "a") as f:
            f.write(f"{epoch}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", required=True)
    p.add_argument("--out_dir", required=True)
    p.add_argument("--resume", default="")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step_s", type=float, default=0.02)
    p.add_argument("--kill_after", default="")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)

    def train(model, opt):
        for _ in range(a.steps):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(a.step_s)
        return loss.item()

    if a.layout == "accelerate":
        main_accelerate(a, train)
    else:
        model, opt = model_and_opt()
        first = load_epoch(a.layout, a.resume, model, opt) if a.resume else 1
        record_start(a.out_dir, first)
        for epoch in range(first, a.epochs + 1):
            loss = train(model, opt)
            if a.layout == "imagenet":
                save_imagenet(a.out_dir, epoch, model, opt, is_best=epoch == 1)
            elif a.layout == "timm":
                save_timm(a.out_dir, epoch, model, opt, metric=loss)
            elif a.layout == "deepspeed":
                save_deepspeed(a.out_dir, epoch, model, opt)
            elif a.layout == "composer":
                save_composer(a.out_dir, epoch, epoch * a.steps, model, opt)
            elif a.layout == "dcp":
                save_dcp(a.out_dir, epoch, model, opt)
            maybe_die(a, epoch)
    with open(os.path.join(a.out_dir, "done.json"), "w") as f:
        json.dump({"epochs": a.epochs}, f)


if __name__ == "__main__":
    main()
