"""The pieces of distributed support that need no second process: the torchrun argv the CLI
builds, the world-size rule on restore, and which rank names a failure."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from observed import observed
from typer.testing import CliRunner

from rtrain.checkpoint import generation
from rtrain.supervisor import cli
from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import StateMismatch
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.launch import resize


@pytest.fixture
def launched(monkeypatch, tmp_path):
    seen = {}
    import rtrain.supervisor.launch.loop as launch_mod

    def fake(spec, seams=None):
        seen["argv"] = spec.command
        return 0

    monkeypatch.setattr(launch_mod, "launch", fake)
    monkeypatch.chdir(tmp_path)
    return seen


def invoke(*args):
    return CliRunner().invoke(cli.app, ["launch", *args])


def test_nproc_per_node_runs_the_script_under_torchrun(launched):
    r = invoke("--nproc-per-node", "2", "train.py", "--lr", "0.1")
    assert r.exit_code == 0, r.output
    assert launched["argv"] == [sys.executable, "-m", "torch.distributed.run",
                                "--nproc-per-node=2", "--max-restarts=0", "--standalone",
                                "train.py", "--lr", "0.1"]


def test_several_nodes_name_the_rendezvous(launched):
    r = invoke("--nproc-per-node", "8", "--nnodes", "2", "--rdzv-endpoint", "h0:29400",
               "-m", "pkg.train")
    assert r.exit_code == 0, r.output
    assert launched["argv"][3:] == ["--nproc-per-node=8", "--max-restarts=0", "--nnodes=2",
                                    "--rdzv-backend=c10d", "--rdzv-endpoint=h0:29400",
                                    "--rdzv-id=rtrain", "-m", "pkg.train"]


def test_several_nodes_without_endpoint_is_refused(launched):
    r = invoke("--nproc-per-node", "8", "--nnodes", "2", "train.py")
    assert r.exit_code != 0 and "--rdzv-endpoint" in r.output


def test_own_torchrun_command_after_double_dash_runs_as_is(launched):
    torchrun = sys.executable  # any executable path stands in for torchrun here
    r = invoke("--", torchrun, "--nproc-per-node=2", "train.py", "--resume")
    assert r.exit_code == 0, r.output
    assert launched["argv"] == [torchrun, "--nproc-per-node=2", "train.py", "--resume"]


def test_world_size_rule():
    pytest.importorskip("torch")
    from rtrain.worker.dist import World
    from rtrain.worker.saving.dist_ckpt import check_world

    sharded = {"world_size": 4, "layout": "sharded"}
    assert check_world(sharded, World(0, 2), True, False, "checkpoint-9") == "sharded"
    replicated = {"world_size": 2, "layout": "replicated"}
    assert check_world(replicated, World(1, 2), False, False, "checkpoint-9") == "replicated"
    with pytest.raises(StateMismatch, match="saved by world size 2, this run has world size 4"):
        check_world(replicated, World(0, 4), False, False, "checkpoint-9")
    assert check_world(replicated, World(0, 4), False, True, "checkpoint-9") == "replicated"
    with pytest.raises(StateMismatch, match=r"world size 2.*world size 4"):
        check_world(replicated, World(0, 4), True, False, "checkpoint-9")


def test_earliest_failing_rank_names_the_attempt():
    ev = observed(returncode=1, exit_records=[
        {"kind": "crash", "reason": "gloo: connection closed by peer", "rank": 0, "time": 12.0},
        {"kind": "crash", "reason": "ValueError: bad batch", "rank": 1, "time": 10.0}])
    f = classify(ev, memory_pressure_fraction=Config().memory_pressure_fraction)
    assert f.reason.startswith("rank 1: ValueError: bad batch (failed first")


def test_torchrun_root_cause_names_a_rank_without_exit_record():
    tail = ("[rank0]: RuntimeError: Connection closed by peer\n"
            "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-30_03:08:34\n"
            "  host      : localhost\n  rank      : 1 (local_rank: 1)\n"
            "  exitcode  : -9 (pid: 8026)  (SIGKILL)\n  error_file: <N/A>\n"
            "  traceback : Signal 9 (SIGKILL) received by PID 8026\n" + "=" * 60 + "\n")
    f = classify(observed(returncode=1, stderr_tail=tail, first_step_seen=True, last_step=20),
                 memory_pressure_fraction=Config().memory_pressure_fraction)
    assert "rank 1 failed first: Signal 9 (SIGKILL) received by PID 8026" in f.reason


@pytest.mark.parametrize("manifest, saved", [
    ({"info": {"world_size": 2, "layout": "replicated"}}, 2),
    ({"info": {"world_size": 1}}, 1),
    ({"info": {}}, None),
    ({"info": {"world_size": True}}, None),  # not a size
    ({"info": {"world_size": 0}}, None),
    ({"info": "x"}, None),
    ({}, None),
    (None, None),
])
def test_saved_world_size_from_the_manifest(manifest, saved):
    assert resize.saved_world_size(manifest) == saved


@pytest.mark.parametrize("saved, heard, new", [
    (2, 1, 1),        # a node lost, the survivor alone
    (2, 4, 4),        # more nodes than wrote the checkpoint
    (2, 2, None),     # the same group
    (None, 1, None),  # a fresh start or a checkpoint without a size: nothing to compare
    (2, None, None),  # a heartbeat outside torchrun says nothing
])
def test_world_watch_reports_a_changed_size_once(saved, heard, new):
    w = resize.WorldWatch(saved)
    assert w.heard(heard) == new
    assert (w.heard(heard) is None and w.heard(7) is None) or heard is None


def test_world_watch_waits_for_a_heartbeat_that_carries_a_size():
    w = resize.WorldWatch(2)
    assert w.heard(None) is None
    assert w.heard(1) == 1


A, B, C = (generation.node_key("host", Path(f"runs/node-{n}")) for n in "abc")


@pytest.mark.parametrize("tokens, current, commits", [
    ("a" * 32, ["a" * 32], True),
    ("a" * 32, ["b" * 32], False),
    (["a" * 32, "b" * 32], ["b" * 32], True),   # one file shared: any node's is the current
    (["a" * 32, "b" * 32], ["c" * 32], False),  # a newer attempt of some node fenced the group
    ([], ["c" * 32], True),                     # no supervisor gave a token: unchecked
    (None, ["c" * 32], True),
    # Each node its own file: the group commits while every one of its nodes holds its token.
    ([A + "1" * 32, B + "2" * 32], [A + "1" * 32, B + "2" * 32], True),
    ([A + "1" * 32, B + "2" * 32], [A + "1" * 32, B + "3" * 32], False),  # node b moved on
    # A node outside the group (a replacement not yet joined) fences nothing.
    ([A + "1" * 32], [A + "1" * 32, B + "3" * 32, C + "4" * 32], True),
])
def test_a_group_commits_while_each_of_its_nodes_holds_its_generation(tmp_path, tokens,
                                                                       current, commits):
    for token in current:
        generation.advance(tmp_path, token)
    if commits:
        with generation.committing(tmp_path, tokens, "checkpoint-3"):
            pass
    else:
        with (pytest.raises(generation.StaleWriter, match="checkpoint-3 not committed"),
              generation.committing(tmp_path, tokens, "checkpoint-3")):
            pass


def test_a_nodes_generation_lies_in_its_own_file_named_by_its_key(tmp_path):
    a, a_again = generation.node_token(A), generation.node_token(A)
    generation.advance(tmp_path, a)
    generation.advance(tmp_path, generation.node_token(B))
    assert (tmp_path / f".rtrain-generation-{A}").read_text() == a
    assert not (tmp_path / ".rtrain-generation").exists()
    generation.advance(tmp_path, a_again)  # the same node again: its file, in place
    assert (tmp_path / f".rtrain-generation-{A}").read_text() == a_again
    assert len({A, B, C}) == 3 and generation.node_key("host", Path("runs/node-a")) == A
