"""Warm ranks end to end: `rtrain launch --nproc-per-node 2` (gloo, CPU), rank 1 SIGKILLed in
attempt 0 (under torchrun); attempt 1 starts both ranks from the warm standby, which hosts their
store, and they resume from one step (the memory tier on: a part per rank); then SIGTERM to rtrain
reaches every rank, which saves at one step boundary, and rtrain exits 75.

Soak: a launch, a standby's torch import and a second attempt take most of a minute on two
shared cores. The rank host's behaviour is tests/test_warm_ranks.py's in the default tier, and
test_data_dist's and test_dist_resume's relaunches go through it there."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import pytest
from harness import CHILDREN, child_env, events, launch_cmd, rank_steps

from rtrain.supervisor.records.runstate import load_state

GRACE_S = 60.0


@pytest.mark.slow
@pytest.mark.soak
def test_a_relaunched_group_starts_warm_resumes_from_one_step_and_stops_on_sigterm(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    cmd = launch_cmd(run, "--grace", str(GRACE_S), "--no-backoff", "--nproc-per-node", "2",
                     str(CHILDREN / "dist_train.py"), str(out), "400", "--step-sleep", "0.2",
                     "--die-at", "4", "--memory", "1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    try:
        while len([s for a, s in rank_steps(out, 1) if a == 1]) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "attempt 1 never stepped"
            time.sleep(0.1)
        launches = events(run, "launch")
        assert [la["standby"] for la in launches] == [False, True], launches
        host = launches[1]["pid"]
        ranks = psutil.Process(host).children()
        assert len(ranks) == 2 and all(p.ppid() == host for p in ranks)
        wanted = {p.pid for p in ranks}
        while not wanted <= {pid for pid, _ in json.loads(
                (run / "procs.json").read_text())["procs"]}:  # the run's record of its tree
            assert time.monotonic() < deadline, "procs.json never named the warm ranks"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=GRACE_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-3000:]
    resumed = {r: [s for a, s in rank_steps(out, r) if a == 1] for r in (0, 1)}
    assert resumed[0][0] == resumed[1][0], f"the group resumed from two steps: {resumed}"
    assert resumed[0][-1] == resumed[1][-1], f"the ranks stopped at two steps: {resumed}"
    stopped_at = resumed[0][-1]
    assert (run / "checkpoints" / f"checkpoint-{stopped_at}" / "manifest.json").exists()
    assert events(run, "classification")[-1]["failure"] == "preempted"
    assert load_state(run).status.value == "preempted"
    start = int(launches[1]["resume_from"].rpartition("-")[2]) + 1  # the step it chose
    assert resumed[0][0] == resumed[1][0] == start, resumed
