"""Two nodes on one machine: two `rtrain launch --nnodes ... --rdzv-endpoint 127.0.0.1:PORT`
supervisors, one rank each, separate run dirs and one shared checkpoint dir.

A node lost whole (its supervisor and every process under it SIGKILLed) comes back as a new
machine would: a new supervisor with an empty run dir. It joins the survivor (one rendezvous id
for every node, no per-node attempt counter in it), both resume the same checkpoint and the run
ends as an uninterrupted one does, bit for bit. With `--nnodes 1:2` a node that never comes
back is not waited for past the rendezvous' last call: the survivor goes on alone and says so.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from bitwise import assert_bitwise_equal
from harness import CHILDREN, child_env, events, finish_node, lose_node, node_cmd, wait_for
from references import rank_state, two_ranks
from s3server import free_port

pytestmark = pytest.mark.slow

TRAIN = str(CHILDREN / "dist_train.py")


def _node(tmp: Path, name: str, port: int, nnodes: str, *args: str) -> subprocess.Popen:
    """One node's `rtrain launch`, output to files."""
    with open(tmp / f"{name}.err", "wb") as err:
        return subprocess.Popen(node_cmd(tmp, name, port, nnodes, *args), cwd=tmp,
                                env=child_env(), stdout=subprocess.DEVNULL, stderr=err)


@pytest.mark.soak  # a minute of two nodes and a third; two nodes are test_dist_nodes_preempt's
def test_a_lost_node_replaced_by_a_new_one_resumes_with_the_survivor(tmp_path):
    ref = two_ranks("18")
    port = free_port()
    a = _node(tmp_path, "a", port, "2", TRAIN, str(tmp_path / "out-a"), "18", "--sleep", "0.4")
    b = _node(tmp_path, "b", port, "2", TRAIN, str(tmp_path / "out-b"), "18", "--sleep", "0.4")
    try:
        wait_for(tmp_path / "ck" / "checkpoint-6" / "manifest.json", timeout=180)
        lose_node(b)
        # A new machine: nothing of node b's run dir, the same checkpoint dir.
        b2 = _node(tmp_path, "b2", port, "2", TRAIN, str(tmp_path / "out-b2"), "18", "--sleep",
                   "0.4")
        finish_node(a, tmp_path / "a.err")
        finish_node(b2, tmp_path / "b2.err")
    finally:
        for p in (a, b):
            if p.poll() is None:
                lose_node(p)
    a_launches = events(tmp_path / "run-a", "launch")
    (b2_launch,) = events(tmp_path / "run-b2", "launch")
    assert len(a_launches) == 2
    assert b2_launch["attempt"] == 0  # its own count starts again; the rendezvous id has none
    resumed = Path(a_launches[1]["resume_from"]).name
    assert resumed != "" and Path(b2_launch["resume_from"]).name == resumed
    assert int(resumed.split("-")[1]) >= 6
    assert events(tmp_path / "run-a", "finished") and events(tmp_path / "run-b2", "finished")
    assert not events(tmp_path / "run-a", "world_size_changed")
    for rank in (0, 1):
        (mine,) = [p for p in tmp_path.glob(f"out-*-rank{rank}.pt") if "out-b-" not in p.name]
        got = torch.load(mine, weights_only=False)
        want = rank_state(ref, rank)
        assert got["step"] == want["step"] == 18
        assert_bitwise_equal(want, got, f"rank{rank}")


@pytest.mark.soak  # waits out torchrun's last call
def test_a_node_that_never_comes_back_leaves_the_survivor_alone(tmp_path):
    port = free_port()
    resize = str(CHILDREN / "dist_resize.py")
    a = _node(tmp_path, "a", port, "1:2", resize, str(tmp_path / "out-a"), "12", "4", "--sleep",
              "0.4")
    b = _node(tmp_path, "b", port, "1:2", resize, str(tmp_path / "out-b"), "12", "4", "--sleep",
              "0.4")
    try:
        wait_for(tmp_path / "ck" / "checkpoint-4" / "manifest.json", timeout=180)
        lose_node(b)
        finish_node(a, tmp_path / "a.err")
    finally:
        for p in (a, b):
            if p.poll() is None:
                lose_node(p)
    launches = events(tmp_path / "run-a", "launch")
    assert len(launches) == 2
    resumed = Path(launches[1]["resume_from"]).name
    (changed,) = events(tmp_path / "run-a", "world_size_changed")
    assert changed["attempt"] == 1 and changed["checkpoint"] == resumed
    assert (changed["world_size"], changed["saved_world_size"]) == (1, 2)
    last = torch.load(tmp_path / "out-a-step12.pt", weights_only=False)
    # 64 samples, 8 a step: step 12 is half-way through the second epoch, at any world size.
    assert (last["world"], last["epoch"], last["position"]) == (1, 1, 32)
    assert f"the group has 1 rank; {resumed} was written by 2" in (tmp_path / "a.err").read_text()
    assert events(tmp_path / "run-a", "finished")
