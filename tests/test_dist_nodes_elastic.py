"""A whole node lost under `--nnodes 1:2`, end to end: two `rtrain launch` nodes on this
machine, one rank each, their own run dirs and one shared checkpoint dir. Once node a's warm
standby is ready, node b's supervisor and every process under it are SIGKILLed and a
replacement node is started at once, as a scheduler would.

Node a's relaunch starts from its standby and goes on alone at once (its rendezvous' last call
is a second, not torch's 30), from the newest checkpoint at world size 1; when the replacement
(torchrun, importing torch cold) waits to join, a's host stops its group and a's next warm
relaunch takes it in: the run ends at world size 2 on both nodes, its data position
that of an uninterrupted run.

Soak: three launches' torch imports and four attempts on two shared cores take a minute or
more. The host's parts are test_rank_membership.py's in the default tier."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
from harness import CHILDREN, child_env, events, finish_node, lose_node, node_cmd
from s3server import free_port

from rtrain.supervisor.records.events import read_events

TOTAL, EVERY = 1004, 8  # long enough for a standby to get ready on loaded cores
RESIZE = str(CHILDREN / "dist_resize.py")


def _node(tmp: Path, name: str, port: int) -> subprocess.Popen:
    # Half a second a step: node a's standby gets ready on loaded cores, and the survivor is
    # still training alone when the replacement, importing torch cold, arrives. Once the group
    # grew back the test writes `fast`, and the rest of the run takes no sleeps.
    with open(tmp / f"{name}.err", "wb") as err:
        return subprocess.Popen(
            node_cmd(tmp, name, port, "1:2", RESIZE, str(tmp / f"out-{name}"), str(TOTAL),
                     str(EVERY), "--sleep", "0.5", "--until", str(tmp / "fast")),
            cwd=tmp, env=child_env(), stdout=subprocess.DEVNULL, stderr=err)


def _grown(tmp: Path) -> bool:
    """The group resumed at two nodes again: its rank 0 (on node a or b2) wrote what it
    restored, with the world size, to out-<node>-loaded.pt (children/dist_resize.py)."""
    for path in tmp.glob("out-*-loaded.pt"):
        if path.name == "out-b-loaded.pt":
            continue  # the lost node's
        try:
            if torch.load(path, weights_only=False)["world"] == 2:
                return True
        except (OSError, EOFError, RuntimeError, KeyError):
            pass  # being written
    return False


def _ready(tmp: Path) -> bool:
    log = tmp / "run-a" / "events.jsonl"
    return (log.exists() and any((tmp / "ck").glob("checkpoint-*/manifest.json"))
            and any(e["kind"] == "standby_ready" for e in read_events(log)))


@pytest.mark.slow
@pytest.mark.soak
def test_a_node_lost_under_a_range_goes_on_alone_warm_and_takes_the_replacement_in(tmp_path):
    port = free_port()
    a, b = _node(tmp_path, "a", port), _node(tmp_path, "b", port)
    b2 = None
    try:
        deadline = time.monotonic() + 400
        while not _ready(tmp_path):
            assert a.poll() is None and b.poll() is None, (tmp_path / "a.err").read_text()
            assert time.monotonic() < deadline, "no checkpoint and warm standby on node a"
            time.sleep(0.1)
        for old in tmp_path.glob("out-*-loaded.pt"):
            old.unlink()  # what a restore before the loss wrote
        lose_node(b)
        b2 = _node(tmp_path, "b2", port)  # a new machine: an empty run dir
        while not _grown(tmp_path):
            assert a.poll() is None and b2.poll() is None, (tmp_path / "a.err").read_text()
            assert time.monotonic() < deadline, "the group never grew back to two nodes"
            time.sleep(0.1)
        (tmp_path / "fast").touch()
        finish_node(a, tmp_path / "a.err", timeout=400)
        finish_node(b2, tmp_path / "b2.err", timeout=120)
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                lose_node(p)
    run_a = tmp_path / "run-a"
    launches = events(run_a, "launch")
    assert [la["standby"] for la in launches][:2] == [False, True], launches
    assert all(la["standby"] for la in launches[1:]), launches  # every relaunch warm
    sizes = [(c["attempt"], c["world_size"], c["saved_world_size"])
             for c in events(run_a, "world_size_changed")]
    assert sizes[0] == (1, 1, 2), sizes  # alone at once, from what both nodes saved
    grew = [c for c in events(run_a, "classification")
            if "waiting to join the rendezvous" in c.get("reason", "")]
    assert grew and all(c["failure"] == "preempted" for c in grew), events(run_a,
                                                                         "classification")
    # The replacement's attempts, started while node a trained alone, fenced none of its
    # commits (each node its own generation): no attempt of a's ended on a refused commit.
    for log in (run_a / "attempts").glob("*/stderr.log"):
        assert "its run has moved on" not in log.read_text(errors="replace"), log
    assert events(run_a, "finished") and events(tmp_path / "run-b2", "finished")
    (end,) = [p for p in tmp_path.glob(f"out-*-step{TOTAL}.pt") if p.name.startswith(
        ("out-a-", "out-b2-"))]  # rank 0's, on either node
    last = torch.load(end, weights_only=False)
    # 64 samples, 8 a step: step 1004 is half-way through epoch 125, at any world size.
    assert (last["world"], last["step"], last["epoch"], last["position"]) == (2, TOTAL, 125, 32)
