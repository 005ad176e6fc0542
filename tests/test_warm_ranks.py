"""Warm ranks (proc/ranks.py, standby/rank_host.py): a standby hands one node's group to itself,
forks the ranks and hosts their c10d store, as torchrun's agent would.

The process tests hand a real standby (no preload: ready in milliseconds) a torch-free probe
(children/rank_probe.py), and compare what its ranks see with what torchrun's ranks see."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from harness import CHILDREN, child_env, run_to_end
from s3server import free_port

from rtrain.supervisor.decide.classify import _torchrun_root_cause
from rtrain.supervisor.proc import ranks
from rtrain.supervisor.proc.spawn import ChildSpec
from rtrain.supervisor.proc.stop import signal_group
from rtrain.supervisor.proc.torchrun import TorchrunSpec, torchrun_command
from rtrain.supervisor.standby.rank_host import summary
from rtrain.supervisor.standby.warm_child import WarmChild, strip_attempt_vars, target_of

PROBE = str(CHILDREN / "rank_probe.py")
# Each attempt's own, under torchrun too (a fresh agent per attempt): never compared.
PER_ATTEMPT = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")


def _command(*args: str, module: bool = False) -> list[str]:
    if module:  # `-m rank_probe`, found from the working directory (CHILDREN)
        return torchrun_command(TorchrunSpec(nproc_per_node=2), None, "rank_probe", list(args))
    return torchrun_command(TorchrunSpec(nproc_per_node=2), PROBE, None, list(args))


# ------------------------------------------------------------------ the supervisor's side


def test_only_rtrains_one_node_torchrun_is_taken_over():
    plan = ranks.plan_of(torchrun_command(TorchrunSpec(nproc_per_node=3), "train.py", None,
                                          ["--lr", "1"], "py"))
    assert plan == ranks.RankPlan("py", 3, "script", "train.py", ("--lr", "1"))
    assert plan.rank_argv() == ["py", "train.py", "--lr", "1"]
    assert plan.orig_argv() == ["py", "-u", "train.py", "--lr", "1"]  # torchrun's `python -u`
    module = ranks.plan_of(torchrun_command(TorchrunSpec(nproc_per_node=2), "a", "pkg.train",
                                            ["b"], "py"))
    assert module is not None and module.rank_argv() == ["py", "-m", "pkg.train", "a", "b"]
    run = ["py", "-m", "torch.distributed.run", "--nproc-per-node=2"]
    for other in (["py", "train.py"], [*run, "train.py"],  # a torchrun of the user's own
                  [*run, "--max-restarts=0", "--standalone", "--rdzv-conf=x", "train.py"],
                  ["torchrun", "train.py"]):
        assert ranks.plan_of(other) is None
    cwd = Path("/w")  # the standby preloads for the script the ranks run
    assert target_of(["py", "-m", "torch.distributed.run", "--nproc-per-node=2",
                      "--max-restarts=0", "--standalone", "train.py", "x"], cwd) == target_of(
        ["py", "train.py"], cwd)


def test_rtrains_torchrun_over_several_nodes_is_taken_over_with_its_rendezvous():
    several = torchrun_command(TorchrunSpec(nproc_per_node=2, nnodes="2",
                                            rdzv_endpoint="h:29400"), "train.py", None,
                               ["--lr", "1"], "py")
    plan = ranks.plan_of(several)
    assert plan is not None and plan.several_nodes and plan.nproc == 2
    assert plan.rank_argv() == ["py", "train.py", "--lr", "1"]
    assert plan.torchrun == tuple(several[3:])  # what the host hands torchrun's own parser
    assert target_of(several, Path("/w")) == target_of(["py", "train.py"], Path("/w"))
    one = ranks.plan_of(torchrun_command(TorchrunSpec(nproc_per_node=2), "train.py", None, []))
    assert one is not None and not one.several_nodes
    # Another rendezvous backend, an option rtrain does not write, one given twice: torchrun.
    other = [a.replace("--rdzv-backend=c10d", "--rdzv-backend=etcd-v2") for a in several]
    assert ranks.plan_of(other) is None
    assert ranks.plan_of([*several[:4], "--rdzv-conf=timeout=9", *several[4:]]) is None
    assert ranks.plan_of([*several[:4], "--nnodes=3", *several[4:]]) is None
    assert ranks.plan_of([a for a in several if not a.startswith("--rdzv-id")]) is None
    # A range of nodes too: the host restarts its group for a node waiting to join
    # (test_rank_membership.py).
    assert ranks.plan_of([a.replace("--nnodes=2", "--nnodes=1:2") for a in several])
    assert ranks.plan_of([a.replace("--nnodes=2", "--nnodes=2:2") for a in several])
    # Each rank's variables but the rendezvous' come with the hand-off; the host adds those.
    spec = ranks.handoff(plan, {"A": "1"}, Path("/a"), 30.0)["ranks"]
    assert spec["rdzv"] == {"torchrun": list(several[3:]), "short_last_call": True,
                            "failed_at": None}
    for local, env in enumerate(spec["envs"]):
        assert env["LOCAL_RANK"] == str(local) and env["LOCAL_WORLD_SIZE"] == "2"
        assert not set(ranks.RDZV_VARIABLES) & set(env)
        assert env["TORCHELASTIC_ERROR_FILE"] == f"/a/rank-{local}-error.json"


def test_the_standby_imports_with_what_torchrun_sets_for_every_rank():
    plan = ranks.RankPlan("py", 2, "script", "t.py", ())
    assert ranks.standby_env({"A": "1"}, plan)["OMP_NUM_THREADS"] == "1"
    assert ranks.standby_env({"OMP_NUM_THREADS": "4"}, plan)["OMP_NUM_THREADS"] == "4"
    assert "OMP_NUM_THREADS" not in ranks.standby_env({}, ranks.RankPlan("py", 1, "script",
                                                                         "t.py", ()))


def test_the_failure_summary_is_torchruns_and_names_the_first_failed_rank():
    text = summary("train.py", [(1, 4242, -9, time.time(), "/nonexistent"),
                                (0, 4241, 1, time.time(), "/nonexistent")])
    assert _torchrun_root_cause(text) == ("torchrun: rank 1 failed first: Signal 9 (SIGKILL) "
                                          "received by PID 4242")
    assert "train.py FAILED" in text and "rank      : 0 (local_rank: 0)" in text


# ------------------------------------------------------------------ a real host


def _attempt_env(tmp: Path) -> dict[str, str]:
    return child_env(RTRAIN_ATTEMPT="1", PYTHONUNBUFFERED="1", RTRAIN_STATUS=str(tmp))


def _hand_off(tmp: Path, name: str, mode: str, grace_s: float = 30.0, module: bool = False):
    """A standby started for the probe's group, handed an attempt running it in `mode`."""
    out = tmp / name
    out.mkdir()
    command = _command(str(out), mode, module=module)
    plan = ranks.plan_of(command)
    env = _attempt_env(tmp)
    warm = WarmChild.spawn(target_of(command, CHILDREN), strip_attempt_vars(
        ranks.standby_env(env, plan)), CHILDREN, tmp, [])
    warm.wait_ready(60)
    assert warm.failed is None, warm.failed
    spec = ChildSpec(argv=command, env=env, cwd=CHILDREN, attempt_dir=tmp / f"{name}-attempt")
    child = warm.activate(spec, ranks.handoff(plan, env, spec.attempt_dir, grace_s))
    return child, out


def _records(out: Path, n: int = 2, timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while not all((out / f"rank{r}.json").exists() for r in range(n)):
        assert time.monotonic() < deadline, f"no rank records in {out}"
        time.sleep(0.02)
    time.sleep(0.05)  # written in one call: let it land
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _listening(pid: int, port: int) -> bool:
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
               for c in psutil.Process(pid).net_connections(kind="tcp"))


@pytest.mark.slow
def test_a_warm_rank_sees_what_a_rank_of_torchrun_sees(tmp_path):
    under = tmp_path / "torchrun"
    under.mkdir()
    r = subprocess.run(_command(str(under), "ok"), env=_attempt_env(tmp_path), cwd=CHILDREN,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    cold = _records(under)
    child, out = _hand_off(tmp_path, "warm", "ok")
    assert run_to_end(child) == 0
    warm = _records(out)
    for rank, (c, w) in enumerate(zip(cold, warm, strict=True)):
        ce, we = ({k: v for k, v in rec["env"].items() if k not in PER_ATTEMPT}
                  for rec in (c, w))
        assert we == ce, f"rank {rank}: {set(we.items()) ^ set(ce.items())}"
        assert we["RANK"] == we["LOCAL_RANK"] == str(rank) and we["WORLD_SIZE"] == "2"
        assert we["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the host serves the store
        for key in ("argv", "orig_argv"):  # each run's own OUT aside
            assert ([a.replace(str(out), "OUT") for a in w[key]]
                    == [a.replace(str(under), "OUT") for a in c[key]]), key
        # The ranks are the host's children, in its process group (a stop signal reaches them).
        assert w["ppid"] == w["pgid"] == child.pid
        assert Path(w["env"]["TORCHELASTIC_ERROR_FILE"]).parent.name == "warm-attempt"


@pytest.mark.slow
def test_a_failed_rank_ends_the_others_and_is_named_first(tmp_path):
    child, out = _hand_off(tmp_path, "a", "fail")
    recs = _records(out)
    port = int(recs[0]["env"]["MASTER_PORT"])
    code = run_to_end(child)
    assert code == 1  # torchrun's status for a failed group
    assert (out / "term0").read_text() != "[]", "rank 0 never got SIGTERM"
    err = (tmp_path / "a-attempt" / "stderr.log").read_text()
    assert _torchrun_root_cause(err) == (
        "torchrun: rank 1 failed first: To enable traceback see: "
        "https://pytorch.org/docs/stable/elastic/errors.html"), err[-2000:]
    assert "exitcode  : 3 (pid: " in err
    assert port == int(recs[1]["env"]["MASTER_PORT"])


@pytest.mark.slow
def test_each_attempt_meets_in_a_store_on_a_fresh_port_and_a_stop_reaches_every_rank(tmp_path):
    ports = []
    for name in ("a", "b"):
        child, out = _hand_off(tmp_path, name, "stop", grace_s=30)
        recs = _records(out)
        port = int(recs[0]["env"]["MASTER_PORT"])
        assert {r["env"]["MASTER_PORT"] for r in recs} == {str(port)}
        deadline = time.monotonic() + 30  # the host's c10d store listens there
        while not _listening(child.pid, port):
            assert time.monotonic() < deadline, "the host serves no store on MASTER_PORT"
            time.sleep(0.05)
        ports.append(port)
        t0 = time.monotonic()
        assert signal_group(child, signal.SIGTERM)  # what rtrain's stop does
        time.sleep(0.2)
        assert child.popen.poll() is None, "the host did not wait for its ranks"
        assert run_to_end(child) == 1
        assert time.monotonic() - t0 >= 0.5  # each rank's save ran to its end
        for rank in (0, 1):
            assert (out / f"term{rank}").read_text() != "[]", f"rank {rank} got no SIGTERM"
        assert not psutil.pid_exists(recs[0]["pid"]) and not psutil.pid_exists(recs[1]["pid"])
    assert ports[0] != ports[1]


@pytest.mark.slow
@pytest.mark.soak  # the script case runs in the default tier
def test_a_module_runs_in_every_rank_as_python_m_runs_it(tmp_path):
    child, out = _hand_off(tmp_path, "m", "ok", module=True)
    assert run_to_end(child) == 0
    for rank, rec in enumerate(_records(out)):
        assert rec["env"]["RANK"] == str(rank)
        assert rec["argv"] == [str(CHILDREN / "rank_probe.py"), str(out), "ok"]  # runpy's
        assert rec["orig_argv"][1:] == ["-u", "-m", "rank_probe", str(out), "ok"]


@pytest.mark.slow
def test_a_warm_node_and_a_torchrun_node_form_one_group_through_torchs_rendezvous(tmp_path):
    """Two nodes of one rank on this machine: one hosted warm, one under torchrun (its first
    attempt, or a standby not ready). The rank torchrun started and the warm one see the same
    variables but their rank's; the warm host waits at the agents' exit barrier, so torchrun
    ends at once too."""
    out = tmp_path / "out"
    out.mkdir()
    command = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="2",
                                            rdzv_endpoint=f"127.0.0.1:{free_port()}"),
                               PROBE, None, [str(out), "ok"])
    plan = ranks.plan_of(command)
    env = _attempt_env(tmp_path)
    warm = WarmChild.spawn(target_of(command, CHILDREN), strip_attempt_vars(
        ranks.standby_env(env, plan)), CHILDREN, tmp_path, ["torch"])
    warm.wait_ready(60)
    assert warm.failed is None, warm.failed
    cold = subprocess.Popen(command, env=env, cwd=CHILDREN, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        spec = ChildSpec(argv=command, env=env, cwd=CHILDREN, attempt_dir=tmp_path / "att")
        child = warm.activate(spec, ranks.handoff(plan, env, spec.attempt_dir, 30.0))
        assert run_to_end(child) == 0, (tmp_path / "att" / "stderr.log").read_text()[-3000:]
        assert cold.wait(timeout=60) == 0, cold.stderr.read()[-3000:]
    finally:
        if cold.poll() is None:
            cold.kill()
    recs = _records(out)
    by = {Path(r["env"]["TORCHELASTIC_ERROR_FILE"]).parent.name == "att": r for r in recs}
    assert set(by) == {True, False}, "not one warm rank and one torchrun rank"
    w, c = by[True], by[False]
    assert w["ppid"] == child.pid  # forked by the host, not started by torchrun
    own = ("RANK", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_ERROR_FILE")
    we, ce = ({k: v for k, v in r["env"].items() if k not in own} for r in (w, c))
    assert we == ce, set(we.items()) ^ set(ce.items())
    assert we["WORLD_SIZE"] == we["GROUP_WORLD_SIZE"] == "2"
    assert we["TORCHELASTIC_RUN_ID"] == "rtrain" and we["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    assert {w["env"]["RANK"], c["env"]["RANK"]} == {"0", "1"}
    for r in (w, c):
        assert r["env"]["RANK"] == r["env"]["GROUP_RANK"] == r["env"]["ROLE_RANK"]


def test_a_rendezvous_found_closed_is_joined_again_once_the_failed_groups_store_is_gone():
    """The failed group's store outlives it until its last agent ends, its rendezvous closed:
    a warm relaunch that comes back first joins again (a new store on the endpoint, here this
    process's) instead of failing an attempt per try, as a relaunched torchrun would."""
    import threading
    from datetime import timedelta

    from torch.distributed import TCPStore

    from rtrain.supervisor.standby import rank_rdzv

    port = free_port()
    args = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="1",
                                         rdzv_endpoint=f"127.0.0.1:{port}"), PROBE, None, [])[3:]
    old = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=30), wait_for_workers=False)
    _, handler = rank_rdzv.handler_for(args)
    handler.set_closed()  # what the failed group's torchrun did at its end
    got: dict = {}

    def join() -> None:
        try:
            got["joined"] = rank_rdzv.join(args)
        except BaseException as e:  # reported below
            got["error"] = e

    thread = threading.Thread(target=join, daemon=True)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive() and not got, got  # it waits while the old store is up
    del handler, old  # the failed group's last agent ends, and its store with it
    thread.join(30)
    assert "joined" in got, got
    joined = got["joined"]
    assert [e["RANK"] for e in joined.envs()] == ["0"]
    assert joined.envs()[0]["WORLD_SIZE"] == "1"
    joined.shutdown()


@pytest.mark.slow
@pytest.mark.soak  # the default tier has no seconds to spare: the rendezvous' own are above
def test_a_stop_while_the_host_waits_in_the_rendezvous_ends_the_attempt_at_once(tmp_path):
    """The other node never comes: the host waits in the rendezvous, its rank waits for its
    variables. rtrain's stop signal to the attempt's group ends the rank, and the host with
    it, torchrun's summary printed, rather than after the rendezvous' 600 s join timeout."""
    out, port = tmp_path / "out", free_port()
    out.mkdir()
    command = torchrun_command(TorchrunSpec(nproc_per_node=1, nnodes="2",
                                            rdzv_endpoint=f"127.0.0.1:{port}"),
                               PROBE, None, [str(out), "ok"])
    plan = ranks.plan_of(command)
    env = _attempt_env(tmp_path)
    warm = WarmChild.spawn(target_of(command, CHILDREN), strip_attempt_vars(
        ranks.standby_env(env, plan)), CHILDREN, tmp_path, ["torch"])
    warm.wait_ready(60)
    assert warm.failed is None, warm.failed
    spec = ChildSpec(argv=command, env=env, cwd=CHILDREN, attempt_dir=tmp_path / "att")
    child = warm.activate(spec, ranks.handoff(plan, env, spec.attempt_dir, 30.0))
    deadline = time.monotonic() + 30
    while not _listening(child.pid, port):
        assert time.monotonic() < deadline, "the host never served the rendezvous' store"
        time.sleep(0.05)
    assert len(psutil.Process(child.pid).children()) == 1  # its rank, waiting
    t0 = time.monotonic()
    assert signal_group(child, signal.SIGTERM)
    assert run_to_end(child) == 1
    assert time.monotonic() - t0 < 10
    err = (tmp_path / "att" / "stderr.log").read_text()
    assert "Signal 15 (SIGTERM)" in err, err[-2000:]
    assert not (out / "rank0.json").exists()  # the script never ran
