"""The GPU paths against a real GPU: NVML's readings against nvidia-smi, a real CUDA
out-of-memory error (allocated until CUDA fails) under rtrain and in the in-process back-off,
the pressure watch on GPU memory, async saves from CUDA state restored bitwise, the warm
standby handing over to an attempt that uses CUDA, a DCP save over NCCL.

Every test here is marked `gpu` and skips, saying why, where torch sees no CUDA device; on a
GPU machine `scripts/gpu_check.sh` runs them all and prints a summary (DEVELOPERS.md)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from chaos_util import write_config
from harness import CHILDREN, child_env, events, launch, rtrain_cmd

import rtrain
from rtrain.supervisor.proc.gpu import NvmlReader

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False): run scripts/gpu_check.sh there"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
SCRIPT = CHILDREN / "gpu_train.py"
MiB = 1 << 20


def smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not on PATH")
def test_nvml_readings_match_nvidia_smi():
    held = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")  # 2 GiB this process holds
    torch.cuda.synchronize()
    reader = NvmlReader()
    assert reader.available, "NVML (nvidia-ml-py) cannot read this GPU"
    reading = reader.read({os.getpid()})
    rows = smi("gpu=index,memory.used,memory.total")
    assert len(reading.devices) == len(rows)
    for dev, (index, used, total) in zip(reading.devices, rows, strict=True):
        assert dev.index == int(index)
        assert abs(dev.total / MiB - int(total)) <= 1
        assert abs(dev.used / MiB - int(used)) <= 512  # read a moment apart
    mine = reading.process_memory.get(os.getpid())
    if mine is not None:  # None where the driver hides per-process use (containers)
        assert mine >= held.numel()
    health = reader.health()
    assert len(health) == len(rows) and all(h.reachable for h in health), health
    reader.close()


@pytest.mark.slow
def test_a_real_cuda_oom_is_oom_gpu_and_the_relaunch_degrades(tmp_path):
    run = tmp_path / "run"
    r = launch(run, "--set", "batch_size=16", "--set", "grad_accum=1", str(SCRIPT),
               "{ckpt_dir}", "12", "--oom-above", "8", timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [e["failure"] for e in events(run, "classification")] == ["oom_gpu"]
    launches = events(run, "launch")
    assert [(e["settings"]["batch_size"], e["settings"]["grad_accum"]) for e in launches] == \
        [(16, 1), (8, 2)]
    assert "out of memory" in (run / "attempts" / "0" / "stderr.log").read_text().lower()


def test_the_in_process_backoff_survives_a_real_oom():
    free, _ = torch.cuda.mem_get_info()
    per_row = free // 24  # 32 rows at once need more than the device has; 8 rows fit
    model = torch.nn.Linear(4, 1).cuda()
    backoff = rtrain.OOMBackoff(settings={"batch_size": 32, "grad_accum": 1})

    def loss_fn(mb: torch.Tensor) -> torch.Tensor:
        scratch = torch.empty(len(mb) * per_row, dtype=torch.uint8, device="cuda")
        return model(mb).mean() + scratch[:1].float().mean() * 0

    loss = backoff.run(loss_fn, torch.randn(32, 4, device="cuda"))
    assert torch.isfinite(loss)
    assert backoff.backoffs >= 1 and backoff.micro is not None and backoff.micro < 32


@pytest.mark.slow
def test_pressure_on_gpu_memory_stops_and_degrades_before_the_oom(tmp_path):
    write_config(tmp_path / "rtrain.toml", {"batch_size": 16, "grad_accum": 1},
                 sample_interval_s=0.1, pressure={"gpu_fraction": 0.5, "sustain_s": 0.5})
    run = tmp_path / "run"
    r = subprocess.run(rtrain_cmd("launch", "--run-dir", str(run), "-q", str(SCRIPT),
                                  "{ckpt_dir}", "300", "--pressure-above", "8",
                                  "--share", "0.6"),
                       cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    pressure = events(run, "memory_pressure")
    assert pressure and pressure[0]["source"].startswith("gpu"), pressure
    assert "degrade" in [p["action"] for p in pressure], pressure
    assert events(run, "classification")[0]["failure"] == "memory_pressure"
    assert events(run, "exit")[0]["returncode"] == 75  # saved at a step boundary, then out
    launches = events(run, "launch")
    assert launches[1]["settings"]["batch_size"] == 8


@pytest.mark.parametrize("mode", ["thread", "fork"])
def test_async_save_of_cuda_state_restores_bitwise(tmp_path, mode):
    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                    torch.nn.Linear(64, 8)).cuda()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = build(0)
    ck = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path, every=None,
                             saving=rtrain.Saving(async_mode=mode))
    for _ in range(3):
        model(torch.randn(16, 64, device="cuda")).square().mean().backward()
        opt.step()
    ck.save(3)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_opt = [t.clone() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor)]
    rng = torch.cuda.get_rng_state()
    # Change everything after the snapshot: an async save must have written the step-3 state.
    model(torch.randn(16, 64, device="cuda")).square().mean().backward()
    opt.step()
    ck.close()
    model2, opt2 = build(1)
    ck2 = rtrain.Checkpointer(model=model2, optimizer=opt2, ckpt_dir=tmp_path,
                              restoring=rtrain.Restoring(map_location="cuda"))
    assert ck2.restore() == 3
    for k, v in model2.state_dict().items():
        assert v.is_cuda and torch.equal(v, want[k]), k
    got_opt = [t for s in opt2.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got_opt, want_opt, strict=True))
    assert torch.equal(torch.cuda.get_rng_state(), rng)


@pytest.mark.slow
def test_the_standby_hands_over_to_an_attempt_that_uses_cuda(tmp_path):
    run = tmp_path / "run"
    crash = tmp_path / "crashed"
    r = launch(run, str(CHILDREN / "gpu_crash_once.py"), "{ckpt_dir}", str(crash), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not events(run, "standby_failed"), events(run, "standby_failed")
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["standby"] and launches[1]["resume_from"]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a DCP save over NCCL needs 2 GPUs")
def test_dcp_save_over_nccl_resumes(tmp_path):
    run = tmp_path / "run"
    r = launch(run, "--nproc-per-node", "2", str(CHILDREN / "gpu_dcp_train.py"), "{ckpt_dir}",
               str(tmp_path / "crashed"), "10", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["resume_from"].endswith("checkpoint-4")
