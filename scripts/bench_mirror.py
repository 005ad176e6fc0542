"""Mirror benchmark: rtrain's uploads and resumes against baselines measured in the same run,
all against a real S3 endpoint (moto's server on 127.0.0.1, started here).

    python scripts/bench_mirror.py [--size-mib 512] [--rounds 3] [--steps 150]

  upload throughput     Mirror.upload of one checkpoint (hashed while sent, manifest last)
                        vs a plain fsspec put of the same files                  (target >= 0.8x)
  step time             examples/vision under rtrain launch with --mirror vs without, a
                        checkpoint every 10 steps, runs alternated               (target <= 1.05x)
  resume on an empty    rtrain launch on an empty run dir: launch -> the child's first line,
  machine               by checkpoint size, beside the same launch with the checkpoint local

Needs the test extras (moto[server], s3fs): pip install -e '.[dev]'.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rtrain.checkpoint.commit import PendingCheckpoint  # noqa: E402
from rtrain.checkpoint.safetensors_io import TensorBlob  # noqa: E402
from tests.s3server import BUCKET, S3Server  # noqa: E402

MIB = 2**20


def env(server: S3Server, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    e.update(OMP_NUM_THREADS="1", **server.env, **extra)
    return e


def make_checkpoint(ckpt_dir: Path, step: int, size_mib: int, parts: int = 4) -> Path:
    rng = np.random.default_rng(step)
    p = PendingCheckpoint(ckpt_dir, step)
    for i in range(parts):
        a = rng.integers(0, 255, size=size_mib * MIB // parts, dtype=np.uint8)
        p.write_tensors(f"part{i}.safetensors", [TensorBlob("t", "U8", a.shape, memoryview(a))])
    p.write_json("state.json", {"step": step})
    return p.commit({"epoch": 0, "samples_seen": 0})


def upload_throughput(tmp: Path, server: S3Server, size_mib: int, rounds: int) -> None:
    from rtrain.supervisor.mirror.store import open_mirror

    os.environ.update(server.env)
    ckpt = make_checkpoint(tmp / "up", 1, size_mib)
    mirror = open_mirror(f"s3://{BUCKET}/bench-up")
    fs = mirror.fs
    files = sorted(p for p in ckpt.iterdir())
    plain, ours = [], []
    for r in range(rounds):
        dest = f"{BUCKET}/bench-plain/{r}"
        t0 = time.perf_counter()
        fs.put([str(p) for p in files], [f"{dest}/{p.name}" for p in files])
        plain.append(time.perf_counter() - t0)
        fs.rm(dest, recursive=True)
        t0 = time.perf_counter()
        t = mirror.upload(ckpt)
        ours.append(time.perf_counter() - t0)
        assert t.bytes > size_mib * MIB
        mirror.delete(ckpt.name)
    p, o = statistics.median(plain), statistics.median(ours)
    print(f"upload of {size_mib} MiB ({len(files)} files), median of {rounds}:")
    print(f"  plain fsspec put   {p:6.2f} s  {size_mib / p:7.1f} MiB/s")
    print(f"  Mirror.upload      {o:6.2f} s  {size_mib / o:7.1f} MiB/s   "
          f"ratio {p / o:.2f}x (target >= 0.8x)")


def _run_vision(tmp: Path, server: S3Server, steps: int, mirror: str | None) -> float:
    """Seconds per step of examples/vision between its first logged step and its last."""
    run = tmp / f"vision-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(run), "--no-backoff",
           "--config", str(ROOT / "examples/vision/rtrain.toml"),
           "--set", f"steps={steps}", "--set", "save_every=10", "--set", "log_every=1"]
    if mirror:
        cmd += ["--mirror", mirror]
    cmd.append(str(ROOT / "examples/vision/train.py"))
    stamps: dict[int, float] = {}
    with subprocess.Popen(cmd, cwd=tmp, env=env(server), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("step "):
                stamps[int(line.split()[1])] = time.perf_counter()
    assert proc.returncode == 0, f"vision run failed ({proc.returncode})"
    shutil.rmtree(run)
    first, last = 5, max(stamps)  # past the loader's warm-up
    return (stamps[last] - stamps[first]) / (last - first)


def step_time(tmp: Path, server: S3Server, steps: int, rounds: int) -> None:
    bare, mirrored = [], []
    for r in range(rounds):
        bare.append(_run_vision(tmp, server, steps, None))
        mirrored.append(_run_vision(tmp, server, steps, f"s3://{BUCKET}/bench-vision-{r}"))
    b, m = statistics.median(bare), statistics.median(mirrored)
    print(f"examples/vision, {steps} steps, a checkpoint every 10, median of {rounds} runs each:")
    print(f"  without mirror     {b * 1e3:6.1f} ms/step")
    print(f"  with --mirror      {m * 1e3:6.1f} ms/step   ratio {m / b:.3f}x (target <= 1.05x)")


FIRST_LINE = "import sys; print('started', flush=True); sys.exit(0)"


def _time_to_child(tmp: Path, server: S3Server, run: Path, mirror: str | None) -> float:
    cmd = [sys.executable, "-m", "rtrain", "launch", "--run-dir", str(run), "--no-backoff",
           "--ckpt-dir", str(run / "checkpoints")]
    if mirror:
        cmd += ["--mirror", mirror]
    cmd += ["--", sys.executable, "-c", FIRST_LINE]
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, cwd=tmp, env=env(server, RTRAIN_CACHE_DIR=str(tmp / "cache")),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "started":
                took = time.perf_counter() - t0
                break
        else:
            raise AssertionError("the child never started")
        proc.wait()
    return took


def resume_time(tmp: Path, server: S3Server, sizes: list[int]) -> None:
    from rtrain.supervisor.mirror.store import open_mirror

    os.environ.update(server.env)
    print("resume on an empty machine: rtrain launch -> the child's first line")
    print(f"  {'size':>9}  {'local':>8}  {'from mirror':>11}  {'download rate':>13}")
    for size in sizes:
        url = f"s3://{BUCKET}/bench-resume-{size}"
        src = tmp / f"src-{size}"
        ckpt = make_checkpoint(src / "checkpoints", 7, size)
        open_mirror(url).upload(ckpt)
        # Local: the same checkpoint already on disk (verified full before launch).
        local = _time_to_child(tmp, server, src, None)
        empty = tmp / f"empty-{size}"
        remote = _time_to_child(tmp, server, empty, url)
        assert (empty / "checkpoints" / "checkpoint-7").is_dir()
        shutil.rmtree(empty)
        shutil.rmtree(tmp / "cache", ignore_errors=True)
        shutil.rmtree(src)
        # Baseline for the transfer: a plain fsspec get of the same files.
        mirror = open_mirror(url)
        t0 = time.perf_counter()
        mirror.fs.get(f"{mirror.root}/checkpoint-7", str(tmp / "plain-get"), recursive=True)
        plain = time.perf_counter() - t0
        shutil.rmtree(tmp / "plain-get")
        extra = max(remote - local, 1e-9)
        print(f"  {size:>5} MiB  {local:7.2f}s  {remote:10.2f}s  {size / extra:9.0f} MiB/s"
              f"   (plain fsspec get: {size / plain:.0f} MiB/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--resume-sizes", default="64,256,1024")
    args = ap.parse_args()
    server = S3Server().start()
    # The store is another machine in a real deployment; here it shares this one's cores, so
    # it gets the leftovers, as the uploader does, rather than charging its CPU to training.
    os.setpriority(os.PRIO_PROCESS, server.proc.pid, 10)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-mirror-") as d:
            tmp = Path(d)
            upload_throughput(tmp, server, args.size_mib, args.rounds)
            step_time(tmp, server, args.steps, args.rounds)
            resume_time(tmp, server, [int(s) for s in args.resume_sizes.split(",")])
    finally:
        server.stop()


if __name__ == "__main__":
    main()
