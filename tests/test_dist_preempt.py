"""Preemption under torchrun, end to end: SIGTERM to `rtrain launch --nproc-per-node 2` (gloo, CPU)
while the two ranks train. Every rank saves at the same step boundary, rank 0 commits, rtrain
exits 75; the same command again resumes at the next step and ends bitwise-equal to a run that
was never stopped."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from bitwise import assert_bitwise_equal
from harness import CHILDREN, child_env, events, launch_cmd, rank_steps
from references import rank_state, two_ranks

from rtrain.supervisor.records.runstate import load_state

TOTAL = "12"
GRACE_S = 60.0  # torchrun, two torch imports and a save on a shared machine


@pytest.mark.slow
@pytest.mark.soak  # torchrun's preemption is test_dist_nodes_preempt's too, in the default tier
def test_sigterm_under_torchrun_saves_on_every_rank_exits_75_and_resumes_with_no_lost_step(
        tmp_path):
    ref = two_ranks(TOTAL)

    run, out = tmp_path / "run", tmp_path / "out"
    cmd = launch_cmd(run, "--grace", str(GRACE_S), "--nproc-per-node", "2",
                     str(CHILDREN / "dist_train.py"), str(out), TOTAL, "--step-sleep", "0.4")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    # Step 4: past the scheduled save at 3, so the stop's own checkpoint is the newest.
    while not any(s >= 4 for _, s in rank_steps(out, 0)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the ranks never reached step 4"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=GRACE_S + 60)
    assert proc.returncode == 75, err[-3000:]

    last = {rank: rank_steps(out, rank)[-1] for rank in (0, 1)}
    assert last[0] == last[1], f"the ranks stopped at different steps: {last}"
    stopped_at = last[0][1]
    assert stopped_at < int(TOTAL), "the run ended before the stop reached it"
    manifest = run / "checkpoints" / f"checkpoint-{stopped_at}" / "manifest.json"
    assert manifest.exists(), "no checkpoint committed at the step the ranks stopped"
    assert '"world_size": 2' in manifest.read_text()
    assert not list((run / "checkpoints").glob(".tmp-*")), "a save was left half-written"
    for rank in (0, 1):  # each rank confirmed its own stop after the commit
        record = run / "attempts" / "0" / f"exit-rank{rank}.json"
        assert not record.exists() or "crash" not in record.read_text()
    (cls,) = events(run, "classification")
    assert cls["failure"] == "preempted", cls
    assert events(run, "decision")[-1]["action"] == "exit_preempted"
    assert load_state(run).status.value == "preempted"

    r = subprocess.run(cmd, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                       timeout=150)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]
    launches = events(run, "launch")
    assert len(launches) == 2
    assert launches[1]["resume_from"].endswith(f"checkpoint-{stopped_at}")
    for rank in (0, 1):
        steps = rank_steps(out, rank)
        resumed = [s for a, s in steps if a == 1]
        assert resumed[0] == stopped_at + 1, f"rank {rank}: lost or repeated steps: {steps}"
        assert [s for _, s in steps] == list(range(1, int(TOTAL) + 1)), steps
        a, b = rank_state(ref, rank), rank_state(out, rank)
        assert a["step"] == b["step"] == int(TOTAL)
        assert_bitwise_equal(a, b, f"rank{rank}")
