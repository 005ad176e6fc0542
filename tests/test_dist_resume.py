"""2 ranks on CPU (gloo) under `rtrain launch --nproc-per-node 2`: a killed rank, a hung rank and
a save interrupted on one rank, each followed by a relaunch of the whole group.

Every run here is a real torchrun with two training processes, so the runs are short (a handful
of steps of a tiny model) and the timeouts generous (the machine may be shared).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tuned
from bitwise import assert_bitwise_equal
from harness import events, launch_2_ranks
from references import rank_state, two_ranks


def _fsdp_available() -> str | None:
    """None when FSDP2 (fully_shard) can run on CPU/gloo here, else the reason."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "torch.distributed with gloo is not available"
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        return f"FSDP2 / DCP state_dict helpers missing: {e}"
    return None


def _kill_one_rank_and_compare(tmp_path: Path, *flags: str) -> None:
    ref = two_ranks("12", *flags)  # the run test_dist_preempt compares with, too
    run = tmp_path / "split"
    # Rank 1 dies by SIGKILL after step 7; checkpoints at 3 and 6; the group resumes at 6.
    r = launch_2_ranks(run, str(tmp_path / "split"), "12", "--die-at", "7", "--die-rank", "1",
                       *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2
    assert launches[1]["resume_from"].endswith("checkpoint-6")
    (cls,) = events(run, "classification")
    assert "rank 1" in cls["reason"] and "injected kill" in cls["reason"], cls
    for rank in (0, 1):
        a, b = rank_state(ref, rank), rank_state(tmp_path / "split", rank)
        assert a["step"] == b["step"] == 12
        assert_bitwise_equal(a, b, f"rank{rank}")
    manifest = (run / "checkpoints" / "checkpoint-9" / "manifest.json").read_text()
    assert "rng-rank1.safetensors" in manifest and '"world_size": 2' in manifest


@pytest.mark.slow
@pytest.mark.soak  # a rank killed, bitwise, is test_data_dist's in the default tier
def test_ddp_kill_of_one_rank_resumes_bitwise(tmp_path):
    _kill_one_rank_and_compare(tmp_path)


@pytest.mark.slow
@pytest.mark.soak
def test_fsdp_kill_of_one_rank_resumes_bitwise(tmp_path):
    why = _fsdp_available()
    if why:
        print(f"skipping FSDP: {why}")
        pytest.skip(why)
    _kill_one_rank_and_compare(tmp_path, "--fsdp")
    files = sorted(p.name for p in (tmp_path / "split" / "checkpoints" / "checkpoint-9" / "dcp")
                   .iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_hung_rank_is_detected_and_the_group_relaunched(tmp_path):
    run = tmp_path / "run"
    # Neither rank can act on the stop signal (one sleeps, one waits in the collective), so
    # the grace is only waited out: a short one.
    (tmp_path / "rtrain.toml").write_text("[hang]\ntimeout_s = 8.0\n")
    tuned.write(tmp_path, {"hang": {"grace_s": 2.0}})
    # Rank 1 sleeps forever in step 4; rank 0 waits for it in a collective.
    r = launch_2_ranks(run, str(tmp_path / "out"), "6",
                       extra_env={"RTRAIN_FAULTS": "hang@step=4,rank=1"})
    assert r.returncode == 0, r.stderr[-3000:]
    (cls,) = events(run, "classification")
    assert cls["failure"] == "hang", cls
    # Rank 1 sleeps in maybe_save(4) before its step-4 boundary; rank 0 passed it and waits in
    # the Checkpointer's all-reduce.
    (stuck,) = events(run, "stuck_ranks")
    assert stuck["behind"] == [1], stuck
    assert stuck["summary"].startswith("rank 1 is in step 4"), stuck
    assert "rank 0 waits at the end of step 4" in stuck["summary"], stuck
    assert "waiting in all_reduce" in stuck["summary"], stuck
    (ended,) = [e for e in events(run, "exit") if e["attempt"] == 0]
    assert ended["exited_at"] - ended["hang_at"] < 12  # stacks, then the 2 s grace
    assert len(events(run, "launch")) == 2
    assert events(run, "finished")


@pytest.mark.slow
@pytest.mark.soak  # two launches of a group; the commit protocol is unit-tested
def test_save_interrupted_on_one_rank_never_commits(tmp_path):
    run = tmp_path / "run"
    # Rank 1 is SIGKILLed after writing its first file of the step-6 checkpoint.
    r = launch_2_ranks(run, str(tmp_path / "out"), "7",
                       extra_env={"RTRAIN_FAULTS": "kill_in_save@step=6,rank=1"})
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2
    # checkpoint-6 never committed in attempt 0: the relaunch resumed from checkpoint-3.
    assert launches[1]["resume_from"].endswith("checkpoint-3")
    ckpts = run / "checkpoints"
    assert (ckpts / "checkpoint-6" / "manifest.json").exists()  # written again by attempt 1
