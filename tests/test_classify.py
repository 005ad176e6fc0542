"""classify(): each rule, by table."""

from __future__ import annotations

import pytest
from observed import observed

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.decide.observation import Observation

FRACTION = Config().memory_pressure_fraction  # what rtrain launch classifies with

GiB = 2**30
K = FailureKind


def ev(**kw) -> Observation:
    # No default pid: the watcher sets it (Observation(pid=child.pid)); cases that check the
    # sentence naming it give one, as the watcher would.
    kw.setdefault("first_step_seen", True)
    return observed(**kw)


CASES = [
    ("exit record names the kind",
     ev(returncode=1, exit_records=[{"kind": "nonfinite", "reason": "loss is nan", "rank": 0,
                                     "step": 40}]),
     K.NONFINITE, ["loss is nan", "step 40"]),
    ("most specific record of several ranks, rank named",
     ev(returncode=1, exit_records=[
         {"kind": "crash", "reason": "NCCL timeout", "rank": 0},
         {"kind": "oom_gpu", "reason": "CUDA out of memory", "rank": 3}]),
     K.OOM_GPU, ["rank 3: CUDA out of memory"]),
    ("unknown record kind is a crash",
     ev(returncode=1, exit_records=[{"kind": "weird", "reason": "?"}]), K.CRASH, []),
    ("exit 75 on its own", ev(returncode=75), K.PREEMPTED, ["on its own", "exit 75"]),
    ("exit 75 after a stop", ev(returncode=75, stop_requested="SIGUSR1"), K.PREEMPTED,
     ["on SIGUSR1"]),
    ("stop confirmed by the workers, agent exit 1 (torchrun)",
     ev(returncode=1, stop_requested="SIGTERM", stop_confirmed=True), K.PREEMPTED,
     ["after committing a checkpoint", "workers confirmed"]),
    ("stop, killed after grace", ev(pid=123, signal="SIGKILL", stop_requested="SIGTERM",
                                    killed_after_grace=True),
     K.PREEMPTED, ["did not save", "grace", "Signal 9 (SIGKILL) received by PID 123"]),
    ("hang", ev(signal="SIGTERM", hang=True, hang_detail="no heartbeat for 600 s"), K.HANG,
     ["no heartbeat for 600 s"]),
    ("hang, with the stuck rank named", ev(signal="SIGKILL", hang=True,
                                           hang_detail="no heartbeat for 60 s",
                                           stuck_summary="rank 3 is in step 5"), K.HANG,
     ["no heartbeat for 60 s", "stopped by rtrain", "; rank 3 is in step 5"]),
    ("hang, then exit 75 on rtrain's own stop (a child that had stopped itself)",
     ev(pid=123, returncode=75, hang=True, hang_detail="no heartbeat for 60 s"), K.HANG,
     ["no heartbeat for 60 s", "stopped by rtrain; it then committed a checkpoint and exited "
      "(PID 123 exited with code 75)"]),
    ("hang, then a stop signal reached rtrain, exit 75: the job is being stopped",
     ev(returncode=75, hang=True, stop_requested="SIGTERM"), K.PREEMPTED, ["on SIGTERM"]),
    ("lost device", ev(returncode=1, gpu_lost=True, gpu_detail="Xid 79"), K.LOST_DEVICE,
     ["Xid 79"]),
    ("CUDA OOM in stderr", ev(returncode=1, stderr_tail="Traceback\ntorch.OutOfMemoryError: CUDA "
                                                        "out of memory. Tried to allocate 2 GiB\n"),
     K.OOM_GPU, ["Tried to allocate 2 GiB"]),
    ("CUBLAS alloc", ev(returncode=1, stderr_tail="CUBLAS_STATUS_ALLOC_FAILED"), K.OOM_GPU, []),
    ("HIP OOM", ev(returncode=1, stderr_tail="HIP out of memory"), K.OOM_GPU, []),
    ("CUDA OOM before the first step is still an OOM",
     ev(returncode=1, first_step_seen=False, stderr_tail="CUDA out of memory"), K.OOM_GPU, []),
    ("SIGKILL with cgroup OOM kills", ev(signal="SIGKILL", cgroup_oom_kills=1), K.OOM_HOST,
     ["OOM killer killed 1"]),
    ("data-loader worker OOM-killed, main exits 1", ev(returncode=1, cgroup_oom_kills=2),
     K.OOM_HOST, ["OOM killer"]),
    ("SIGKILL, host memory near exhaustion",
     ev(signal="SIGKILL", host_mem_total=64 * GiB, host_mem_available_min=1 * GiB),
     K.OOM_HOST, ["host memory available fell"]),
    ("SIGKILL, RSS near total", ev(signal="SIGKILL", host_mem_total=10 * GiB,
                                   peak_rss_bytes=int(9.5 * GiB)), K.OOM_HOST, ["peaked"]),
    ("SIGKILL without memory pressure is a crash",
     ev(signal="SIGKILL", host_mem_total=64 * GiB, host_mem_available_min=40 * GiB,
        peak_rss_bytes=2 * GiB), K.CRASH, ["someone killed it", "Signal 9 (SIGKILL)"]),
    ("SIGKILL without any readings is a crash", ev(signal="SIGKILL"), K.CRASH,
     ["someone killed it"]),
    ("MemoryError", ev(returncode=1, stderr_tail="  x = [0] * n\nMemoryError\n"), K.OOM_HOST,
     ["MemoryError"]),
    ("bad_alloc", ev(signal="SIGABRT", stderr_tail="terminate called after throwing an instance "
                                                   "of 'std::bad_alloc'"), K.OOM_HOST, []),
    ("stop requested, died of the forwarded signal", ev(signal="SIGTERM", stop_requested="SIGTERM"),
     K.PREEMPTED, ["without confirming a checkpoint"]),
    ("startup: ImportError, before the first step",
     ev(pid=123, returncode=1, first_step_seen=False,
        stderr_tail="Traceback (most recent call last):\n  File \"t.py\"\n"
                    "ModuleNotFoundError: No module named 'foo'\n"),
     K.STARTUP, ["before its first step", "No module named 'foo'", "PID 123 exited with code 1"]),
    ("crash after steps, with exit code and last line",
     ev(pid=123, returncode=2, last_step=500, stderr_tail="ValueError: bad shape\n"), K.CRASH,
     ["PID 123 exited with code 2 at step 500: ValueError: bad shape"]),
    ("segfault", ev(pid=123, signal="SIGSEGV"), K.CRASH,
     ["Signal 11 (SIGSEGV) received by PID 123"]),
    ("without a pid the sentence says the child", ev(returncode=2), K.CRASH,
     ["the child exited with code 2"]),
]


@pytest.mark.parametrize(("name", "seen", "kind", "phrases"), CASES, ids=[c[0] for c in CASES])
def test_classify(name, seen, kind, phrases):
    failure = classify(seen, memory_pressure_fraction=FRACTION)
    assert failure.kind is kind, failure.reason
    for phrase in phrases:
        assert phrase in failure.reason
    assert failure.seen is seen
    assert failure.signal == seen.signal and failure.exit_code == seen.exit_code


def test_memory_pressure_fraction_is_a_parameter():
    e = ev(signal="SIGKILL", host_mem_total=100, host_mem_available_min=15)
    assert classify(e, memory_pressure_fraction=FRACTION).kind is K.CRASH
    assert classify(e, memory_pressure_fraction=0.8).kind is K.OOM_HOST


def test_exit_zero_is_not_a_failure():
    with pytest.raises(ValueError):
        classify(ev(returncode=0), memory_pressure_fraction=FRACTION)
