"""With DataLoader workers, a run split into processes (save, die, new process, restore, fresh
iter(loader)) ends bitwise-identical to an uninterrupted one: the position counts the samples the
loop consumed, not those prefetched. Augmentation in the workers uses rtrain.sample_generator.

How many workers load a map-style dataset, and how they prefetch or pin, changes no value a step
trains on: the split runs below with batches of 8 are all compared with one uninterrupted run
without workers (a stronger claim than one uninterrupted run per configuration, and three fewer
processes). Other cases, and the claims that a split run is *not* exact, keep their own.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
from data_split import TOTAL, run, split_vs_whole, whole

from rtrain.worker.data import data_workers

SOAK = pytest.mark.soak  # the worker matrix; its densest configuration is the default tier's
DENSEST = ["--workers", "2", "--persistent", "--pin", "--prefetch", "3"]
CONFIGS = {
    "W0": ["--workers", "0"],
    "W2": ["--workers", "2"],
    "W2-persistent-pin-prefetch3": DENSEST,
    "W4-persistent-prefetch1": ["--workers", "4", "--persistent", "--prefetch", "1"],
}


@pytest.mark.slow
@SOAK
@pytest.mark.parametrize("args", [pytest.param(a, id=k) for k, a in CONFIGS.items()])
def test_split_run_with_workers_is_bitwise_identical(tmp_path, args):
    # Resumed mid-epoch (at step 3) and at an epoch's end (step 12).
    assert split_vs_whole(tmp_path, args, reference=whole(["--workers", "0"])) is None


@pytest.mark.slow
@pytest.mark.soak  # split vs whole with workers: test_data_dist.py's rank kill (default tier)
def test_split_run_resumed_mid_epoch_with_batches_prefetched_is_bitwise_identical(tmp_path):
    # Killed after step 5, resumed from step 3 while two workers held
    # six batches prefetched past it, then three epoch ends in the resumed process.
    assert split_vs_whole(tmp_path, DENSEST, (5,), reference=whole(["--workers", "0"])) is None


@pytest.mark.slow
@SOAK
def test_split_run_with_workers_and_an_odd_batch_is_bitwise_identical(tmp_path):
    # Batches of 5: epochs end on a partial batch at a different step than batches of 8.
    assert split_vs_whole(tmp_path, ["--workers", "4", "--pin", "--batch", "5"]) is None


@pytest.mark.slow
@SOAK
def test_sampler_only_idiom_stays_exact_without_workers(tmp_path):
    # The bare sampler as loader= (the loop iterates a DataLoader the Checkpointer was not
    # given), num_workers=0: exact. Compared with its own uninterrupted run, which does not
    # match the DataLoader-as-loader= one bit for bit.
    assert split_vs_whole(tmp_path, ["--workers", "0", "--loader", "none"]) is None


@pytest.mark.slow
@SOAK
def test_sampler_only_idiom_with_workers_is_not_exact(tmp_path):
    # Why loader= is needed: the sampler alone counts prefetched samples as consumed, so the
    # first resume mid-epoch (at step 3) already skips samples.
    assert split_vs_whole(tmp_path, ["--workers", "2", "--loader", "none"], (5,)) is not None


@pytest.mark.slow
@SOAK
def test_worker_global_rng_is_not_reproducible_mid_epoch(tmp_path):
    # What the README says is not reproducible: augmentation drawn from the worker's own
    # generator (torch seeds workers per iterator, and each advanced per sample it processed).
    assert split_vs_whole(tmp_path, ["--workers", "2", "--aug", "global"], (5,)) is not None


@pytest.mark.slow
@pytest.mark.soak  # workers end with the trainer: the split-run tests kill it with workers up
def test_worker_still_starting_when_the_training_process_dies_exits(tmp_path):
    # Killed after step 1, the first batch of a fresh iterator, which worker 0 delivered while
    # worker 1 was still in its worker_init_fn: torch's watchdog, started after that, took init
    # for worker 1's parent and it waited for work forever, holding the child's stdout and
    # stderr, so this run never returned (a test run under load hung this way). Now it ends
    # within the worker's next look at its parent (ORPHAN_CHECK_S) after its init.
    r = run(tmp_path / "ckpt", tmp_path / "out.pt", TOTAL, 1, "--data", "iterable",
            "--workers", "2", "--slow-worker", "3")
    assert r.returncode == 9, r.stderr[-3000:]


@pytest.mark.slow
def test_a_parent_that_is_a_zombie_counts_as_gone(monkeypatch):
    # A dead training process whose last thread is still leaving stays the worker's parent
    # until it has gone too: its state (Z) already says it is dead.
    live = subprocess.Popen(["sleep", "30"])
    dead = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{dead.pid}/stat").read_bytes().rpartition(b")")[2].split()[0] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for pid, gone in ((live.pid, False), (dead.pid, True)):
            monkeypatch.setattr(os, "getppid", lambda pid=pid: pid)
            assert data_workers._gone(pid) is gone
    finally:
        live.kill()
        live.wait()
        dead.wait()


@pytest.mark.slow
def test_a_stop_that_reaches_a_worker_before_its_init_is_left_to_the_training_process(
        monkeypatch):
    # A stop sent to the whole process group (rtrain's, Slurm's, a container's) can reach a worker
    # of a fresh iterator (a new epoch without persistent workers) after torch installed its
    # SIGTERM handler, which dies of a SIGTERM its parent did not send, and before the
    # worker_init_fn that leaves it to the training process: the loader then raised "DataLoader
    # worker exited unexpectedly" instead of the step boundary saving (a preemption test
    # of the default tier under load once). Here each worker gets that SIGTERM there every time.
    import signal

    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data._utils import signal_handling
    from torch.utils.data._utils import worker as torch_worker

    import rtrain

    real_loop = torch_worker._worker_loop

    def loop_stopped_at_birth(*args, **kwargs):
        signal_handling._set_worker_signal_handlers()  # as torch's loop does first
        os.kill(os.getpid(), signal.SIGTERM)  # from a process that is not the parent
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(torch_worker, "_worker_loop", loop_stopped_at_birth)
    data = TensorDataset(torch.arange(32))
    loader = DataLoader(data, batch_size=4, num_workers=2,
                        sampler=rtrain.ResumableSampler(len(data), seed=0))
    ck = rtrain.Checkpointer(model=torch.nn.Linear(1, 1), loader=loader)
    for _epoch in range(2):  # the second epoch starts its workers anew
        assert sorted(i for (b,) in loader for i in b.tolist()) == list(range(32))
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # as it was
    del ck
