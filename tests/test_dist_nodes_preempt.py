"""Two nodes on one machine: two `rtrain launch --nnodes 2 --rdzv-endpoint 127.0.0.1:PORT`
supervisors, one rank each, their own run dirs and one shared checkpoint dir (what
scripts/slurm/train-multinode.sbatch and deploy/kubernetes/indexed-job.yaml run on each node).
Both are preempted with SIGTERM: the ranks save at one step, rank 0 commits into the shared dir,
both supervisors exit 75; the same two commands again resume both ranks at the next step."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from harness import CHILDREN, child_env, events, launch_cmd, rank_steps
from s3server import free_port

pytestmark = pytest.mark.slow

TOTAL = 10


def test_two_supervisors_sharing_a_checkpoint_dir_stop_on_sigterm_and_resume_together(tmp_path):
    out, ckpts = tmp_path / "out", tmp_path / "shared-checkpoints"
    endpoint = f"127.0.0.1:{free_port()}"

    def node(n: int) -> list[str]:
        return launch_cmd(tmp_path / f"node-{n}", "--ckpt-dir", str(ckpts), "--grace", "60",
                          "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                          str(CHILDREN / "dist_train.py"), str(out), str(TOTAL),
                          "--step-sleep", "0.4")

    procs = [subprocess.Popen(node(n), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while not all(any(s >= 4 for _, s in rank_steps(out, r)) for r in (0, 1)):
            assert all(p.poll() is None for p in procs), [p.communicate()[1][-2000:]
                                                          for p in procs]
            assert time.monotonic() < deadline, "the two ranks never reached step 4"
            time.sleep(0.05)
        for p in procs:  # a preemption reaches every node
            p.send_signal(signal.SIGTERM)
        errs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [75, 75], [e[-3000:] for e in errs]
    last = {r: rank_steps(out, r)[-1] for r in (0, 1)}
    assert last[0] == last[1], f"the ranks stopped at different steps: {last}"
    stopped_at = last[0][1]
    assert stopped_at < TOTAL
    assert (ckpts / f"checkpoint-{stopped_at}" / "manifest.json").exists(), \
        "rank 0 did not commit the stop's checkpoint into the shared dir"
    for n in (0, 1):
        (cls,) = events(tmp_path / f"node-{n}", "classification")
        assert cls["failure"] == "preempted", cls

    again = [subprocess.Popen(node(n), cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    try:
        errs = [p.communicate(timeout=150)[1] for p in again]
    finally:
        for p in again:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in again] == [0, 0], [e[-3000:] for e in errs]
    for n in (0, 1):
        launches = events(tmp_path / f"node-{n}", "launch")
        assert launches[-1]["resume_from"].endswith(f"checkpoint-{stopped_at}")
    for rank in (0, 1):
        steps = rank_steps(out, rank)
        assert next(s for a, s in steps if a == 1) == stopped_at + 1, steps
        assert [s for _, s in steps] == list(range(1, TOTAL + 1)), "a step lost or repeated"
