"""Warm ranks over a range of nodes (`--nnodes MIN:MAX`): which commands a host takes over, the
relaunch's short last call, a node waiting to join seen as torchrun's agent sees it (and a node
beyond MAX not seen), and the host's stop for it named and relaunched without charge.

The rendezvous here is torch's own, in this process (threads, a TCPStore on a free port); the
end-to-end run, two `rtrain launch` nodes with one lost whole, is test_dist_nodes_elastic.py."""

from __future__ import annotations

import threading
import time

import pytest
from harness import CHILDREN
from s3server import free_port

from rtrain.supervisor.config import Config
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.decide.observation import Observation
from rtrain.supervisor.decide.policy import Action, History, decide
from rtrain.supervisor.proc import ranks
from rtrain.supervisor.proc.torchrun import TorchrunSpec, torchrun_command
from rtrain.supervisor.standby import rank_host, rank_rdzv

PROBE = str(CHILDREN / "rank_probe.py")


@pytest.mark.parametrize(("nnodes", "ok"), [
    ("2", True), ("1:2", True), ("2:2", True), ("2:4", True), ("0", False), ("0:2", False),
    ("3:2", False), ("1:", False), ("a", False), ("1:x", False), (":2", False)])
def test_a_host_joins_for_a_fixed_count_or_a_range_of_nodes(nnodes, ok):
    assert ranks.node_count(nnodes) is ok
    command = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="2",
                                            rdzv_endpoint="h:1"), "train.py", None, [])
    command = [a.replace("--nnodes=2", f"--nnodes={nnodes}") for a in command]
    assert (ranks.plan_of(command) is not None) is ok


def test_a_relaunch_over_a_range_has_a_short_last_call_unless_one_is_named():
    short = {"last_call_timeout": rank_rdzv.RELAUNCH_LAST_CALL_S}
    assert rank_rdzv.relaunch_conf({}, 1, 2) == short
    assert rank_rdzv.relaunch_conf({"timeout": 9}, 2, 4) == {"timeout": 9, **short}
    assert rank_rdzv.relaunch_conf({"last_call_timeout": 7}, 1, 2) == {"last_call_timeout": 7}
    assert rank_rdzv.relaunch_conf({}, 2, 2) == {}  # a fixed count waits for every node


def test_after_a_stop_for_a_waiting_node_the_next_round_waits_for_it():
    """The host's stop is seen at the attempt's end; the next hand-off drops the short last
    call, so the next round waits (torch's last call) for the node it stopped for."""
    from types import SimpleNamespace

    from rtrain.supervisor.decide.classify import nodes_taken_in
    from rtrain.supervisor.standby.feature import Standby

    line = rank_host.GROW_LINE.format(n=2)
    assert nodes_taken_in(f"x\n{line}\n") == 2 and nodes_taken_in("x\n") is None
    feature = Standby(SimpleNamespace(after_growth=False, hosted=False))
    feature.attempt_end(None, _observed(stderr_tail=line))
    assert feature.slot.after_growth
    feature.attempt_end(None, _observed(returncode=1, stderr_tail=line))
    assert not feature.slot.after_growth  # a failure: the survivors' short last call again
    command = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="1:2",
                                            rdzv_endpoint="h:1"), "train.py", None, [])
    plan = ranks.plan_of(command)
    rdzv = ranks.handoff(plan, {}, CHILDREN, 30.0)["ranks"]["rdzv"]
    assert rdzv == {"torchrun": command[3:], "short_last_call": True, "failed_at": None}
    assert not ranks.handoff(plan, {}, CHILDREN, 30.0,
                             after_growth=True)["ranks"]["rdzv"]["short_last_call"]
    _, short = rank_rdzv.handler_for(_args(free_port(), "1:2"))
    _, torchs = rank_rdzv.handler_for(_args(free_port(), "1:2"), short_last_call=False)
    assert short.settings.timeout.last_call.total_seconds() == rank_rdzv.RELAUNCH_LAST_CALL_S
    assert torchs.settings.timeout.last_call.total_seconds() == 30  # torch's default


def test_a_relaunchs_last_call_counts_from_the_failure():
    """The survivors' groups broke together and each host joins once its failed rank ended:
    the last call is what is left of the relaunch's second since the group broke (as this node
    saw it: its first rank's report of a collective broken by a rank gone; else its exit,
    which broke the others'), never below the least, where the standby hosted the failed
    ranks; after torchrun's attempt, a last call the user named, a fixed count or the round
    after a stop for a node, it stays as it was."""
    from types import SimpleNamespace

    from rtrain.supervisor.core.protocol import Heartbeat
    from rtrain.supervisor.decide.observation import Heartbeats
    from rtrain.supervisor.standby.feature import Standby
    from rtrain.worker import dist

    one, least = rank_rdzv.RELAUNCH_LAST_CALL_S, rank_rdzv.RELAUNCH_LAST_CALL_MIN_S
    assert rank_rdzv.last_call_s(100.0, 100.6) == pytest.approx(one - 0.6)
    assert rank_rdzv.last_call_s(100.0, 105.0) == least  # a slow way out: the least still
    assert rank_rdzv.last_call_s(100.0, 97.0) == one  # another clock's future: no longer

    feature = Standby(SimpleNamespace(after_growth=False, failed_at=None, hosted=True))
    broken = Heartbeats().add(Heartbeat(pid=9, rank=0, time=100.2, event="exception",
                                        reason="RuntimeError", peer_lost=True))
    feature.attempt_end(None, _observed(returncode=1, exited_at=100.7, heartbeats=broken))
    assert feature.slot.failed_at == 100.2  # the group broke elsewhere, then
    own = Heartbeats().add(Heartbeat(pid=9, rank=0, time=100.2, event="exception",
                                     reason="OutOfMemoryError"))
    feature.attempt_end(None, _observed(returncode=1, exited_at=100.7, heartbeats=own))
    assert feature.slot.failed_at == 100.7  # its ranks' end broke the others' collectives
    feature.attempt_end(None, _observed(returncode=-9, exited_at=100.7))
    assert feature.slot.failed_at == 100.7  # killed: no report
    feature.slot.hosted = False  # torchrun ran it: its agent's way out is its own
    feature.attempt_end(None, _observed(returncode=1, exited_at=100.7, heartbeats=broken))
    assert feature.slot.failed_at is None
    # The worker says which: gloo's broken connection and NCCL's aborted communicator, on the
    # wire as a strict bool.
    assert dist.peer_lost(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:26796: "
                                       "Connection reset by peer. This is typically caused"))
    assert dist.peer_lost(RuntimeError("NCCL communicator was aborted on rank 1."))
    assert not dist.peer_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    wire = Heartbeat(pid=9, rank=0, time=1.0, event="exception", peer_lost=True).encode()
    assert Heartbeat.decode(wire).peer_lost is True
    assert Heartbeat.decode(wire.replace(b"true", b'"yes"')).peer_lost is None
    command = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="1:2",
                                            rdzv_endpoint="h:1"), "train.py", None, [])
    handed = ranks.handoff(ranks.plan_of(command), {}, CHILDREN, 30.0, failed_at=100.2)
    assert handed["ranks"]["rdzv"]["failed_at"] == 100.2

    def last_call(args, **kw) -> float:
        _, handler = rank_rdzv.handler_for(args, **kw)
        return handler.settings.timeout.last_call.total_seconds()

    failed_at = time.time() - 0.6
    assert last_call(_args(free_port(), "1:2"), failed_at=failed_at) < one - 0.5
    assert last_call(_args(free_port(), "1:2"), failed_at=time.time() - 9) == least
    named = _args(free_port(), "1:2")
    named.insert(named.index(PROBE), "--rdzv-conf=last_call_timeout=7")
    assert last_call(named, failed_at=failed_at) == 7
    assert last_call(_args(free_port(), "1:2"), short_last_call=False, failed_at=failed_at) == 30
    assert last_call(_args(free_port(), "2"), failed_at=failed_at) == 30  # MAX ends it anyway


@pytest.mark.slow
def test_a_rank_whose_peer_went_away_reports_peer_lost_from_gloos_own_error():
    """The real error gloo raises on a rank whose peer's process ended (its sockets closed, as
    a SIGKILL or a lost node closes them) is read as a broken collective: the `peer_lost` the
    last call counts from."""
    import json
    import subprocess
    import sys

    from harness import child_env

    port = str(free_port())
    probe = str(CHILDREN / "peer_lost_probe.py")
    procs = [subprocess.Popen([sys.executable, probe, str(r), port], env=child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out, err = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=30)
    seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-2000:]}
    assert seen.get("peer_lost") is True, seen


def test_a_waiting_node_reads_the_rendezvous_often_only_in_a_small_group():
    assert rank_rdzv.join_poll_s(2) == rank_rdzv.join_poll_s(rank_rdzv.POLL_NODES) == 0.1
    assert rank_rdzv.join_poll_s(50) == pytest.approx(0.5)
    assert rank_rdzv.join_poll_s(1000) == 1.0  # torch's own
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    slept = []
    torch_delay = dynamic_rendezvous._delay
    dynamic_rendezvous._delay = slept.append
    try:
        with rank_rdzv._polling(0.1):
            dynamic_rendezvous._delay(1)
            dynamic_rendezvous._delay((0, 0.3))  # a first round's skew: none in a small group
            dynamic_rendezvous._delay(5)
        with rank_rdzv._polling(1.0):
            dynamic_rendezvous._delay((0, 0.3))
        dynamic_rendezvous._delay(1)
    finally:
        dynamic_rendezvous._delay = torch_delay
    assert slept == [0.1, 5, (0, 0.3), 1]  # only inside the block


def _observed(**kw) -> Observation:
    base = dict(returncode=75, duration_s=30.0, stderr_tail="")
    base.update(kw)
    return Observation(**base)


def test_the_hosts_stop_for_a_waiting_node_is_named_and_relaunched_at_once_for_nothing():
    line = rank_host.GROW_LINE.format(n=1)
    failure = classify(_observed(stderr_tail=f"...\n{line}\n"), memory_pressure_fraction=0.9)
    assert failure.kind is FailureKind.PREEMPTED
    assert "1 node(s) waiting to join the rendezvous" in failure.reason
    cfg = Config()
    d = decide(failure, History(), cfg, rand=0.5)
    assert d.action is Action.RELAUNCH and d.backoff_s == 0
    assert d.history.budgets_used == {} and d.history.total_restarts == 0  # nothing charged
    # Without the host's line an exit 75 is a stop on its own, as before.
    plain = classify(_observed(), memory_pressure_fraction=0.9)
    assert "waiting" not in plain.reason and plain.kind is FailureKind.PREEMPTED


def _args(port: int, nnodes: str) -> list[str]:
    return torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes=nnodes,
                                         rdzv_endpoint=f"127.0.0.1:{port}"), PROBE, None, [])[3:]


def _join_in_thread(args: list[str]) -> tuple[threading.Thread, dict]:
    """Another node joining the rendezvous (torch's handler, ended by the rendezvous' close)."""
    got: dict = {}
    _, handler = rank_rdzv.handler_for(args)

    def run() -> None:
        try:
            got["info"] = handler.next_rendezvous()
        except BaseException as e:  # the close at the end
            got["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


def _eventually(check, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_node_waiting_to_join_is_seen_and_a_node_beyond_max_is_not():
    """`--nnodes 1:2`: a host alone goes on after its short last call; a second node then waits
    for the next round, which the host sees (it restarts its group for it). `--nnodes 1:1`: a
    second node waits beyond MAX, in the redundancy list, which nobody counts: it never
    restarts a healthy group."""
    args = _args(free_port(), "1:2")
    t0 = time.monotonic()
    joined = rank_rdzv.join(args)
    try:
        assert joined.elastic and joined.info.world_size == 1
        assert time.monotonic() - t0 < 10  # not torch's 30 s last call
        # Its reads of the state are fresh each poll, not a copy a second old (torch's cache).
        assert joined.handler._state_holder._cache_duration == rank_rdzv.join_poll_s(2) < 1
        assert joined.nodes_waiting() == 0
        thread, got = _join_in_thread(args)
        assert _eventually(lambda: joined.nodes_waiting() == 1), got
        assert thread.is_alive() and not got  # it waits for the next round
    finally:
        joined.shutdown()
    thread.join(15)
    assert "error" in got  # the close ended its wait

    args = _args(free_port(), "1:1")
    joined = rank_rdzv.join(args)
    try:
        assert not joined.elastic and joined.info.world_size == 1
        thread, got = _join_in_thread(args)
        state = joined.handler._state_holder  # torch's state, read as its sync reads it

        def spare() -> bool:
            state.sync()
            return len(state.state.redundancy_list) == 1
        assert _eventually(spare), got
        assert joined.nodes_waiting() == 0 and thread.is_alive() and not got
    finally:
        joined.shutdown()
    thread.join(15)
    assert "error" in got
