"""Warm ranks over several nodes, end to end: two `rtrain launch --nnodes 2 --rdzv-endpoint
127.0.0.1:PORT` supervisors on this machine, one rank each, their own run dirs and one shared
checkpoint dir. Rank 1 SIGKILLs itself in attempt 0 (under torchrun on both nodes); the group
fails on both, and attempt 1 starts on each node from its warm standby, which joins torch's
rendezvous as torchrun's agent would and forks the node's rank. Both ranks resume from one step
and the run ends on both nodes.

Soak: two launches, two standbys' torch imports and a second attempt on two shared cores take
most of a minute. The rank host's part over several nodes (a warm node and a torchrun node in one
group) is tests/test_warm_ranks.py's in the default tier."""

from __future__ import annotations

import subprocess

import pytest
from harness import CHILDREN, child_env, events, finish_node, lose_node, node_cmd, rank_steps
from s3server import free_port

TOTAL = 12


@pytest.mark.slow
@pytest.mark.soak
def test_a_relaunched_two_node_group_starts_warm_on_both_nodes_and_resumes_from_one_step(
        tmp_path):
    port, out = free_port(), tmp_path / "out"
    nodes = {}
    for name in ("a", "b"):
        with open(tmp_path / f"{name}.err", "wb") as err:
            nodes[name] = subprocess.Popen(
                node_cmd(tmp_path, name, port, "2", str(CHILDREN / "dist_train.py"), str(out),
                         str(TOTAL), "--step-sleep", "0.2", "--die-at", "4", "--every", "2"),
                cwd=tmp_path, env=child_env(), stdout=subprocess.DEVNULL, stderr=err)
    try:
        for name, proc in nodes.items():
            finish_node(proc, tmp_path / f"{name}.err", timeout=400)
    finally:
        for proc in nodes.values():
            if proc.poll() is None:
                lose_node(proc)
    for name in ("a", "b"):
        launches = events(tmp_path / f"run-{name}", "launch")
        assert [la["standby"] for la in launches] == [False, True], (name, launches)
        assert events(tmp_path / f"run-{name}", "finished")
    resumed = {r: [s for a, s in rank_steps(out, r) if a == 1] for r in (0, 1)}
    assert resumed[0] and resumed[0][0] == resumed[1][0], f"two steps resumed: {resumed}"
    assert resumed[0][-1] == resumed[1][-1] == TOTAL, resumed
    starts = {events(tmp_path / f"run-{n}", "launch")[1]["resume_from"] for n in ("a", "b")}
    assert len(starts) == 1, starts  # both nodes chose the same checkpoint
