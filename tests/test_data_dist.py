"""Two ranks (gloo, CPU) under `rtrain launch --nproc-per-node 2`, each loading its share with a
DistributedResumableSampler and DataLoader workers: a rank killed mid-epoch, the group resumed,
and every rank ends bitwise-identical to an uninterrupted run (its data position exact)."""

from __future__ import annotations

import pytest
import torch
from bitwise import assert_bitwise_equal
from harness import events, launch_2_ranks
from references import rank_state, two_ranks


@pytest.mark.slow
def test_rank_kill_mid_epoch_with_workers_resumes_bitwise(tmp_path):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    args = ("14", "--workers", "2")
    ref = two_ranks(*args)
    run = tmp_path / "split"
    # 24 samples per rank in batches of 4: six steps an epoch. Rank 1 dies after step 10; the
    # group resumes from checkpoint-9, half-way through epoch 1.
    r = launch_2_ranks(run, str(tmp_path / "split"), *args, "--die-at", "10", "--die-rank", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["resume_from"].endswith("checkpoint-9")
    (cls,) = events(run, "classification")
    assert "rank 1" in cls["reason"] and "injected kill" in cls["reason"], cls
    manifest = (run / "checkpoints" / "checkpoint-12" / "manifest.json").read_text()
    assert "rng-rank1.safetensors" in manifest and '"world_size": 2' in manifest
    for rank in (0, 1):
        a, b = rank_state(ref, rank), rank_state(tmp_path / "split", rank)
        assert a["step"] == b["step"] == 14
        assert_bitwise_equal(a, b, f"rank{rank}")
