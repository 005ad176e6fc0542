"""`scripts/slurm/train-multinode.sbatch` on a real two-node Slurm: two slurmd daemons on this
host (`NODES=2 scripts/slurm/local-cluster.sh start`, `slurmd -N <node>`), one rtrain per node
started by srun, the two ranks meeting at the rendezvous on the first node's address.

The job is preempted with `scancel --signal=TERM` (the signal `--signal=TERM@120` sends before
the time limit, to every process of the step on every node): both ranks save at one step,
the first node's rtrain requeues the job, and the requeued job resumes both ranks at the next
step. Skipped, with the reason, where the cluster cannot start; RTRAIN_REQUIRE_SLURM=1 makes
that a failure.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import pytest
from harness import CHILDREN, REPO, rank_steps
from test_slurm import Job, _events, _job_field, _slurm, _wait, running_cluster

MULTI = REPO / "scripts" / "slurm" / "train-multinode.sbatch"
TOTAL = 40

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.xdist_group("slurm"),
              pytest.mark.timeout(900),
              pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test needs Linux")]


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[None]:
    """A running two-node cluster on this host; stopped afterwards unless it ran before."""
    yield from running_cluster(2)


def test_two_node_job_preempted_saves_on_both_nodes_requeues_once_and_resumes(two_nodes,
                                                                               tmp_path):
    out = tmp_path / "out"
    j = Job(tmp_path, str(CHILDREN / "dist_train.py"), str(out), str(TOTAL), "--step-sleep",
            "0.3", script=MULTI)
    nodes = [j.run / "node-0", j.run / "node-1"]

    def diagnose() -> str:
        parts = [j.diagnose()]
        for node in nodes:
            for p in (node / "events.jsonl", *sorted(node.glob("attempts/*/stderr.log"))):
                parts.append(f"--- {p}:\n{p.read_text()[-3000:] if p.exists() else '(missing)'}")
        return "\n".join(parts)

    try:
        _wait("both nodes stepping (step 5)",
              lambda: all(any(s >= 5 for _, s in rank_steps(out, r)) for r in (0, 1)), 120,
              diagnose)
        # What --signal=TERM@120 does before the time limit: every process of the step, on
        # every node, gets SIGTERM (not the batch shell).
        _slurm("scancel", "--signal=TERM", j.id)
        _wait("saved, requeued by the first node's rtrain",
              lambda: any(e["kind"] == "requeue" for e in _events(nodes[0]))
              and _job_field(j.id, "JobState") == "PENDING", 90, diagnose)
        assert _job_field(j.id, "Restarts") == "1"
        last = {r: rank_steps(out, r)[-1] for r in (0, 1)}
        assert last[0] == last[1], f"the ranks stopped at different steps: {last}"
        stopped_at = last[0][1]
        assert stopped_at < TOTAL
        for node in nodes:
            (cls,) = [e for e in _events(node) if e["kind"] == "classification"]
            assert cls["failure"] == "preempted", diagnose()
        assert not [e for e in _events(nodes[1]) if e["kind"] == "requeue"], \
            "only the first node's rtrain requeues the job"
        ckpts = j.run / "checkpoints"
        assert (ckpts / f"checkpoint-{stopped_at}" / "manifest.json").exists(), diagnose()

        time.sleep(2.0)  # not in the second of the requeue (see test_slurm.py)
        _slurm("scontrol", "update", f"JobId={j.id}", "StartTime=now")
        _wait("the requeued job finished",
              lambda: _job_field(j.id, "JobState") not in ("PENDING", "RUNNING", "CONFIGURING",
                                                           "COMPLETING"), 180, diagnose)
    finally:
        j.cancel()

    text = j.log.read_text()
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text, text
    for node in nodes:
        launches = [e for e in _events(node) if e["kind"] == "launch"]
        assert [e["slurm"]["restart_count"] for e in launches] == [0, 1], diagnose()
        assert launches[1]["resume_from"].endswith(f"checkpoint-{stopped_at}")
        assert [e for e in _events(node) if e["kind"] == "finished"], diagnose()
    for rank in (0, 1):
        steps = rank_steps(out, rank)
        assert next(s for a, s in steps if a == 1) == stopped_at + 1, steps
        assert [s for _, s in steps] == list(range(1, TOTAL + 1)), "a step lost or repeated"
