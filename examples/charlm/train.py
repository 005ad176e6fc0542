"""A tiny character-level language model (embedding + GRU) on data.txt, written for rtrain.

Knobs: seq_len, batch_size, grad_accum, lr, steps, amp, workers (DataLoader worker processes;
the Checkpointer is given the loader, so it saves the position the loop consumed). Mixed
precision: float16 autocast with a GradScaler on CUDA (the scaler's state is checkpointed); on
the CPU, bfloat16 autocast (no scaler needed) when `amp` is true. amp's default (null) means on
for CUDA, off for the CPU, where a bfloat16 GRU runs about three times slower than float32.

A sample is a fixed start offset in the text, so the sample count, and with it the resume
position, does not change when the ladder lowers seq_len.
"""

import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import rtrain
from rtrain.worker.guards import faults

STRIDE = 16  # characters between two samples' start offsets


class CharWindows(Dataset):
    def __init__(self, text: str, seq_len: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        self.ids = torch.cat([ids, ids])  # windows near the end wrap around
        self.n, self.seq_len = len(text) // STRIDE, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.ids[i * STRIDE: i * STRIDE + self.seq_len + 1]
        return w[:-1], w[1:]


class CharGRU(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, hidden: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(x))
        return self.head(out)


def forever(loader: DataLoader):
    while True:
        yield from loader


@torch.no_grad()
def generate(model: CharGRU, vocab: list[str], prompt: str, n: int, device: str) -> str:
    x = torch.tensor([[vocab.index(c) for c in prompt if c in vocab]], device=device)
    out = list(prompt)
    for _ in range(n):
        nxt = model(x)[0, -1].argmax()
        out.append(vocab[nxt])
        x = torch.cat([x, nxt.view(1, 1)], dim=1)
    return "".join(out)


def main() -> None:
    s = rtrain.settings(seq_len=64, batch_size=32, grad_accum=1, lr=0.005, steps=150,
                        save_every=20, log_every=10, amp=None, seed=0, workers=2)
    rtrain.install_excepthook()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp_dtype = torch.float16 if device == "cuda" else torch.bfloat16
    amp = device == "cuda" if s.amp is None else bool(s.amp)
    torch.manual_seed(s.seed)
    dataset = CharWindows((Path(__file__).parent / "data.txt").read_text(), s.seq_len)
    sampler = rtrain.ResumableSampler(len(dataset), seed=s.seed)
    loader = DataLoader(dataset, batch_size=s.batch_size, sampler=sampler,
                        num_workers=s.workers)
    model = CharGRU(len(dataset.vocab)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=s.lr)
    # Loss scaling is for float16 only; bfloat16 has float32's range.
    scaler = torch.amp.GradScaler(device, enabled=amp and amp_dtype == torch.float16)
    ckpt = rtrain.Checkpointer(model=model, optimizer=opt, scaler=scaler, loader=loader,
                               every=s.save_every,
                               restoring=rtrain.Restoring(map_location=device))
    start = ckpt.restore()
    for g in opt.param_groups:
        g["lr"] = s.lr  # the lr knob wins over the checkpoint's (cut after a non-finite loss)
    print(f"{'resumed at' if start else 'starting at'} step {start}: settings {dict(s)}",
          flush=True)

    def loss_of(batch, step):
        x, y = batch
        faults.in_step(batch_size=len(x))
        with torch.autocast(device, dtype=amp_dtype, enabled=amp):
            logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / s.grad_accum
        return faults.poison_loss(loss, step)

    backoff = rtrain.OOMBackoff(settings=s)
    guard = rtrain.NonFiniteGuard(max_consecutive=5)
    batches = forever(loader)
    value = float("nan")
    for step in range(start + 1, s.steps + 1):
        loss = torch.zeros((), device=device)
        for _ in range(s.grad_accum):
            x, y = next(batches)
            loss += backoff.run(functools.partial(loss_of, step=step),
                                (x.to(device), y.to(device)),
                                backward=lambda t: scaler.scale(t).backward())
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not guard.skip(loss, model=model, scaler=scaler, step=step):
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if step % s.log_every == 0 or step == start + 1:
            micro = backoff.micro or s.batch_size  # smaller after an in-process back-off
            accum = s.grad_accum * math.ceil(s.batch_size / micro)
            print(f"step {step} loss {value:.4f} batch {micro}x{accum} "
                  f"seq_len {s.seq_len}", flush=True)
        ckpt.maybe_save(step, metrics={"loss": value})
    if start < s.steps:
        ckpt.save(s.steps)
    ckpt.close()
    model.eval()
    print(f"done: {s.steps} steps, final loss {value:.4f}; sample: "
          f"{generate(model, dataset.vocab, 'Shall I ', 40, device)!r}", flush=True)


if __name__ == "__main__":
    main()
