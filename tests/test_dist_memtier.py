"""The memory tier under torchrun: each rank snapshots its part of the step, and a relaunched
group resumes from the newest step whole on every node, bitwise, without a disk checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from bitwise import assert_bitwise_equal
from harness import (
    CHILDREN,
    child_env,
    events,
    finish_node,
    invoke_rtrain,
    launch_2_ranks,
    lose_node,
    node_cmd,
)
from references import rank_state, two_ranks
from s3server import free_port

from rtrain.checkpoint.verify import Level, verify

TRAIN = str(CHILDREN / "dist_train.py")


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_groups_memory_snapshot_bitwise(tmp_path):
    ref = two_ranks("12")
    run = tmp_path / "split"
    # No disk save before the end (every 100): only memory can hold the steps before the kill.
    r = launch_2_ranks(run, str(run), "12", "--every", "100", "--memory", "1", "--die-at", "7",
                       "--die-rank", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = events(run, "recovery")
    # Rank 1 died right after step 7's snapshot began: the group resumes from 6 or 7, whichever
    # every rank committed (never one rank's 7 with another's 6).
    step = rec["resumed_step"]
    assert step in (6, 7), rec
    # rtrain committed that step, the ranks' parts as one checkpoint, before the pick ...
    persisted = events(run, "snapshot_persisted")
    assert [(e["attempt"], e["step"], e["why"]) for e in persisted] == [
        (0, step, "attempt ended"), (1, 12, "attempt ended")], persisted  # 12: the run's end
    launches = events(run, "launch")
    assert len(launches) == 2 and launches[1]["resume_from"].endswith(f"checkpoint-{step}")
    v = verify(run / "checkpoints" / f"checkpoint-{step}", Level.FULL)
    assert v.ok and v.manifest["info"]["world_size"] == 2, v.reason
    assert {"rng-rank0.safetensors", "rng-rank1.safetensors"} <= set(v.manifest["files"])
    # ... and the group read it from memory, where it was whole.
    (resumed,) = events(run, "snapshot_resumed")
    assert resumed["step"] == step and resumed["origin"] == "node", resumed
    assert "resumed from the memory snapshot of step" in r.stderr
    for rank in (0, 1):
        a, b = rank_state(ref, rank), rank_state(run, rank)
        assert a["step"] == b["step"] == 12
        assert_bitwise_equal(a, b, f"rank{rank}")


# ---------------------------------------------------------------- two nodes, one lost whole


def _node(tmp: Path, name: str, port: int, shm: Path, *args: str) -> subprocess.Popen:
    """One node's `rtrain launch` with its own shared memory (RTRAIN_SHM_ROOT: each machine
    has its own /dev/shm)."""
    shm.mkdir(exist_ok=True)
    with open(tmp / f"{name}.err", "wb") as err:
        return subprocess.Popen(node_cmd(tmp, name, port, "2", TRAIN, *args), cwd=tmp,
                                stdout=subprocess.DEVNULL, stderr=err,
                                env=child_env(RTRAIN_SHM_ROOT=str(shm)))


def _wait_event(run: Path, kind: str, timeout: float = 120, **match) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run / "events.jsonl").exists():
            for e in events(run, kind):
                if all(e.get(k) == v for k, v in match.items()):
                    return e
        time.sleep(0.05)
    pytest.fail(f"no {kind} {match} in {run} within {timeout} s")


@pytest.fixture
def shm_roots():
    """Two machines' /dev/shm, and the replacement's, empty."""
    base = Path(tempfile.mkdtemp(prefix="rtrain-test-nodes-", dir="/dev/shm"))
    try:
        yield base / "a", base / "b", base / "b2"
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_a_node_lost_whole_is_restored_from_its_peers_memory_bitwise(tmp_path, shm_roots):
    step, reached, gathered, _ = _lose_a_node_and_replace_it(tmp_path, shm_roots)
    assert reached - 3 <= step <= reached, (step, reached)
    assert gathered["ranks"] == [0, 1], gathered  # the replacement started with nothing
    # Visible where people look: the replacement's status says where its state came from.
    st = invoke_rtrain("status", "--json", str(tmp_path / "run-b2"))
    assert st.returncode == 0, st.stderr
    peer = json.loads(st.stdout)["memory_tier"]["peer"]
    assert peer["state"] in ("gathered", "replicating", "failed"), peer
    text = invoke_rtrain("status", str(tmp_path / "run-b2")).stdout
    [row] = [line for line in text.splitlines() if line.strip().startswith("memory tier:")]
    assert "peer copy" in row or "copying node" in row or "gathered step" in row, row


@pytest.mark.slow
@pytest.mark.soak  # the same two nodes and a third; the copy's refusal is tested in process too
def test_a_tampered_peer_copy_is_refused_and_the_group_resumes_a_step_earlier(tmp_path,
                                                                            shm_roots):
    step, _, _, tampered = _lose_a_node_and_replace_it(tmp_path, shm_roots, tamper=True)
    assert step < tampered, (step, tampered)
    failed = [e for e in events(tmp_path / "run-b2", "peer_copy") if e["state"] == "failed"
              and e["step"] == tampered]
    assert failed and "does not match" in failed[0]["reason"], failed


@pytest.mark.slow
@pytest.mark.soak  # two real nodes; the registry's refusals are tests/test_peer_security.py's
def test_a_link_planted_at_the_peer_registry_deletes_nothing_and_the_nodes_train_on(tmp_path,
                                                                                    shm_roots):
    """A teammate's link at `<ckpt-dir>/.rtrain-peers` to a directory of theirs: each node says
    in one line that it goes without peer copies, nothing there is removed or written, and the
    run finishes."""
    shm_a, shm_b, _ = shm_roots
    victim = tmp_path / "victim"
    victim.mkdir()
    old = time.time() - 7200  # older than the hour after which registry entries are removed
    for name in ("settings.json", "notes.txt"):
        (victim / name).write_text(name)
        os.utime(victim / name, (old, old))
    (tmp_path / "ck").mkdir()
    os.symlink(victim, tmp_path / "ck" / ".rtrain-peers")
    port = free_port()
    args = ("6", "--every", "100", "--memory", "1", "--sleep", "0.1")
    a = _node(tmp_path, "a", port, shm_a, str(tmp_path / "out-a"), *args)
    b = _node(tmp_path, "b", port, shm_b, str(tmp_path / "out-b"), *args)
    try:
        finish_node(a, tmp_path / "a.err", 240)
        finish_node(b, tmp_path / "b.err", 240)
    finally:
        for p in (a, b):
            if p.poll() is None:
                lose_node(p)
    assert sorted(os.listdir(victim)) == ["notes.txt", "settings.json"]
    assert all((victim / n).read_text() == n for n in os.listdir(victim))
    for node in ("a", "b"):
        said = [line for line in (tmp_path / f"{node}.err").read_text().splitlines()
                if "peer copies of the memory tier off" in line]
        assert said and "is a symbolic link" in said[0], node
        assert not events(tmp_path / f"run-{node}", "peer_copy")


def _lose_a_node_and_replace_it(tmp_path: Path, shm_roots, tamper: bool = False
                                ) -> tuple[int, int, dict, int | None]:
    """Two nodes train with a snapshot every step and no disk checkpoint; node b is lost whole
    after step 7 and replaced by an empty machine. With `tamper`, a byte of the survivor's copy
    of b's newest part is flipped first. Checks the run ends bitwise as an uninterrupted one;
    returns (the step resumed, the step reached, the replacement's `gathered`, the step
    tampered)."""
    shm_a, shm_b, shm_b2 = shm_roots
    ref = two_ranks("12")  # the reference of the one-node test above, made once
    port = free_port()
    # No disk checkpoint before the end (every 100): the steps reached live only in memory.
    args = ("12", "--every", "100", "--memory", "1", "--sleep", "0.4")
    a = _node(tmp_path, "a", port, shm_a, str(tmp_path / "out-a"), *args)
    b = _node(tmp_path, "b", port, shm_b, str(tmp_path / "out-b"), *args)
    b2, tampered = None, None
    try:
        # Each node copies the other's parts; wait until node a holds some of b's.
        _wait_event(tmp_path / "run-a", "peer_copy", state="replicating")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and max(_steps(tmp_path, "out-a"), default=0) < 7:
            time.sleep(0.1)
        lose_node(b)
        reached = max(_steps(tmp_path, "out-a"))
        assert not list((tmp_path / "ck").glob("checkpoint-*")), "a disk checkpoint was made"
        if tamper:
            tampered = _flip_a_byte_of_the_newest_copy(shm_a, shm_b)
        # A new machine: empty shared memory, an empty run dir, the same checkpoint dir.
        b2 = _node(tmp_path, "b2", port, shm_b2, str(tmp_path / "out-b2"), *args)
        finish_node(a, tmp_path / "a.err", 240)
        finish_node(b2, tmp_path / "b2.err", 240)
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                lose_node(p)
    (gathered,) = [e for e in events(tmp_path / "run-b2", "peer_copy")
                   if e["state"] == "gathered"]
    resumed = events(tmp_path / "run-a", "snapshot_resumed") + events(
        tmp_path / "run-b2", "snapshot_resumed")
    assert len(resumed) == 1, resumed  # said by the node of rank 0
    step = resumed[0]["step"]
    assert step == gathered["step"], (resumed, gathered)
    # Node a's rtrain relaunched its group (a `recovery` from that step), or, when its rank was
    # still waiting in a collective as the replacement joined, torchrun restarted the rank in
    # place (a membership change: no relaunch, the same memory resume).
    assert all(r["resumed_step"] == step for r in events(tmp_path / "run-a", "recovery"))
    # Where each rank ran, the final states are those of an uninterrupted run.
    outs = {r: p for p in ("out-a", "out-b2") for r in (0, 1)
            if Path(f"{tmp_path / p}-rank{r}.pt").exists()}
    assert set(outs) == {0, 1}, outs
    for rank, out in outs.items():
        a_, b_ = rank_state(ref, rank), rank_state(tmp_path / out, rank)
        assert a_["step"] == b_["step"] == 12
        assert_bitwise_equal(a_, b_, f"rank{rank}")
    return step, reached, gathered, tampered


def _flip_a_byte_of_the_newest_copy(shm_a: Path, shm_b: Path) -> int:
    """In node a's copy of lost node b's newest part, one byte of its largest file flipped (the
    size kept, so only the content hash can tell); that part's step."""
    (b_rank,) = {d.name for d in shm_b.glob("rtrain-*/rank-*")}
    copies = sorted(shm_a.glob(f"rtrain-*/held/{b_rank}/checkpoint-*"),
                    key=lambda p: int(p.name.split("-")[1]))
    newest = copies[-1]
    target = max((f for f in newest.iterdir() if f.suffix == ".safetensors"),
                 key=lambda f: f.stat().st_size)
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    return int(newest.name.split("-")[1])


def _steps(tmp: Path, out: str) -> list[int]:
    """Steps node `out`'s rank ran (children/dist_train.py's .steps file, any rank)."""
    found = []
    for f in tmp.glob(f"{out}-rank*.steps"):
        found += [int(line.split()[1]) for line in f.read_text().splitlines() if line.strip()]
    return found
