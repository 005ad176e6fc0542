"""The trackers' variables an attempt is given (supervisor/trackers/env.py, by table), the
restarts a resumed attempt marks (worker/trackers/restarts.py: `fold` by table, `Restarts` over a
real events.jsonl written as the supervisor writes it) and `Checkpointer.resumed_step`. The real
trackers under `rtrain launch`: tests/test_trackers_launch.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from rtrain import trackers
from rtrain.supervisor.core import protocol
from rtrain.supervisor.launch import child_env
from rtrain.supervisor.trackers import env as tracker_env
from rtrain.supervisor.trackers.feature import Trackers
from rtrain.worker.trackers.restarts import Restart, Restarts, fold

RUN = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


@pytest.mark.parametrize(("env", "mlflow", "expected"), [
    ({}, None, {"RTRAIN_RUN_ID": RUN, "WANDB_RUN_ID": RUN, "WANDB_RESUME": "allow",
                "RTRAIN_TRACKER_VARS": "WANDB_RUN_ID,WANDB_RESUME"}),
    # The user's own id wins, and their resume mode (set or not) with it.
    ({"WANDB_RUN_ID": "mine"}, None, {"RTRAIN_RUN_ID": RUN}),
    ({"WANDB_RESUME": "must"}, None, {"RTRAIN_RUN_ID": RUN, "WANDB_RUN_ID": RUN,
                                      "RTRAIN_TRACKER_VARS": "WANDB_RUN_ID"}),
    # MLflow's id only once the run exists (recorded by the helper), never over the user's.
    ({}, "abc", {"RTRAIN_RUN_ID": RUN, "WANDB_RUN_ID": RUN, "WANDB_RESUME": "allow",
                 "MLFLOW_RUN_ID": "abc",
                 "RTRAIN_TRACKER_VARS": "WANDB_RUN_ID,WANDB_RESUME,MLFLOW_RUN_ID"}),
    ({"WANDB_RUN_ID": "mine", "MLFLOW_RUN_ID": "theirs"}, "abc", {"RTRAIN_RUN_ID": RUN}),
])
def test_tracker_variables_only_where_the_user_set_none(env, mlflow, expected):
    assert tracker_env.variables(RUN, env, mlflow) == expected


def test_no_identity_no_variables():
    assert tracker_env.variables(None, {}, "abc") == {}


def test_the_mlflow_record_counts_for_its_own_run_only(tmp_path):
    assert tracker_env.read_mlflow_run(tmp_path, RUN) is None  # none yet
    (tmp_path / "trackers").mkdir()
    record = tmp_path / tracker_env.MLFLOW_RECORD
    record.write_text(f"{RUN} 5f3e0c1a9b2d4e6f8a7b6c5d4e3f2a1b\n")
    assert tracker_env.read_mlflow_run(tmp_path, RUN) == "5f3e0c1a9b2d4e6f8a7b6c5d4e3f2a1b"
    assert tracker_env.read_mlflow_run(tmp_path, OTHER) is None  # the run started over since
    record.write_text(f"{RUN} ../../etc\n")
    assert tracker_env.read_mlflow_run(tmp_path, RUN) is None


def _plan(tmp_path, run):
    return child_env.AttemptPlan(attempt=2, settings={}, resume_from=None, run_dir=tmp_path,
                                 ckpt_dir=tmp_path / "c", attempt_dir=tmp_path / "a", run=run)


def _env(plan, base):
    """The attempt's environment as a launch builds it: rtrain's, then the trackers feature's."""
    env = child_env.environment(plan, stop_signal="SIGTERM", heartbeat_addr="@x",
                                dump_signal=12, relieve_signal=23, file_mode=0o600, base=base)
    run = SimpleNamespace(run_dir=plan.run_dir, checkpoints=SimpleNamespace(run=plan.run))
    env.update(Trackers(run).environment(None, env))
    return env


def test_every_attempt_environment_carries_the_identity(tmp_path):
    env = _env(_plan(tmp_path, RUN), {"WANDB_PROJECT": "p"})
    assert (env[protocol.ENV_RUN_ID], env["WANDB_RUN_ID"], env["WANDB_RESUME"]) == (
        RUN, RUN, "allow")
    assert "MLFLOW_RUN_ID" not in env
    # An environment handed down from an outer run keeps none of that run's names.
    inner = _env(_plan(tmp_path, None), {protocol.ENV_RUN_ID: OTHER,
                                         protocol.ENV_TRACKER_VARS: "WANDB_RUN_ID"})
    assert protocol.ENV_RUN_ID not in inner and protocol.ENV_TRACKER_VARS not in inner


def _recovery(attempt, failed, failure, **kw):
    return {"kind": "recovery", "attempt": attempt, "failed_attempt": failed,
            "failure": failure, "complete": True, "lost_s": 10.0, "total_s": 8.0,
            "steps_lost": 3, "resumed_step": 5 * attempt, **kw}


def test_fold_waits_for_the_attempts_own_recovery():
    events = [_recovery(1, 0, "crash")]
    assert fold(events, attempt=2, since=-1) is None  # attempt 2 has not reached a step
    assert fold(events, attempt=1, since=-1) == Restart(
        attempt=1, failures=((0, "crash"),), lost_s=10.0, steps_again=3, resumed_step=5,
        degrades=())


def test_fold_takes_the_relaunches_that_died_before_a_step_and_their_degrades():
    events = [_recovery(1, 0, "crash"),
              {"kind": "degrade", "attempt": 1, "change": "batch_size 8 -> 4"},
              _recovery(2, 1, "oom_gpu", complete=False, lost_s=None, steps_lost=None),
              _recovery(3, 2, "crash")]
    r = fold(events, attempt=3, since=1)  # attempt 1 marked its own
    assert r.failures == ((1, "oom_gpu"), (2, "crash"))
    assert (r.lost_s, r.steps_again, r.resumed_step) == (18.0, 3, 15)
    assert r.degrades == ("batch_size 8 -> 4",)
    assert r.metrics() == {"rtrain/attempt": 3, "rtrain/failures": 2, "rtrain/lost_s": 18.0,
                           "rtrain/steps_again": 3, "rtrain/degrades": 1}
    assert r.sentence() == ("attempt 3 resumed from step 15 after attempt 1 oom_gpu, attempt 2 "
                            "crash: 18.0 s lost, 3 steps run again; degraded: batch_size 8 -> 4")


def _run_dir(tmp_path, monkeypatch, attempt):
    status = tmp_path / "attempts" / str(attempt)
    status.mkdir(parents=True)
    monkeypatch.setenv(protocol.ENV_RUN_DIR, str(tmp_path))
    monkeypatch.setenv(protocol.ENV_STATUS, str(status))
    monkeypatch.setenv(protocol.ENV_ATTEMPT, str(attempt))
    return tmp_path / "events.jsonl", status


def test_restarts_logs_once_when_the_supervisor_records_the_cost(tmp_path, monkeypatch):
    log, status = _run_dir(tmp_path, monkeypatch, 1)
    log.write_text(json.dumps({"kind": "launch", "attempt": 1}) + "\n")
    restarts, seen = Restarts(), []
    assert restarts.log(seen.append, step=6) is None
    line = json.dumps(_recovery(1, 0, "crash"))
    with open(log, "a") as f:  # a line half written: read once it is whole
        f.write(line[:20])
    assert restarts.log(seen.append, step=7) is None
    with open(log, "a") as f:
        f.write(line[20:] + "\n")
    assert restarts.log(seen.append, step=8).attempt == 1
    assert restarts.log(seen.append, step=9) is None  # once
    assert [r.failures for r in seen] == [((0, "crash"),)]
    assert (status / trackers.ANNOTATED).exists()


def test_restarts_skips_what_an_earlier_attempt_logged(tmp_path, monkeypatch):
    log, _ = _run_dir(tmp_path, monkeypatch, 2)
    (tmp_path / "attempts" / "1").mkdir()
    (tmp_path / "attempts" / "1" / trackers.ANNOTATED).touch()
    log.write_text("".join(json.dumps(e) + "\n" for e in (
        _recovery(1, 0, "crash"), _recovery(2, 1, "preempted"))))
    assert Restarts().poll().failures == ((1, "preempted"),)


def test_restarts_outside_a_launch_and_in_a_first_attempt_do_nothing(tmp_path, monkeypatch):
    for name in (protocol.ENV_RUN_DIR, protocol.ENV_STATUS, protocol.ENV_ATTEMPT):
        monkeypatch.delenv(name, raising=False)
    assert Restarts().poll() is None
    log, _ = _run_dir(tmp_path, monkeypatch, 0)
    log.write_text(json.dumps(_recovery(0, 0, "crash")) + "\n")  # not this attempt's to log
    assert Restarts().poll() is None


def test_write_refuses_what_it_cannot_log_to():
    r = fold([_recovery(1, 0, "crash")], attempt=1, since=-1)
    with pytest.raises(TypeError, match="pass a wandb Run, a SummaryWriter"):
        trackers.write(object(), r, 5)


def test_resumed_step_is_the_checkpoints_step(tmp_path, monkeypatch):
    for name in (protocol.ENV_RESUME_FROM, protocol.ENV_CKPT_DIR):
        monkeypatch.delenv(name, raising=False)
    import rtrain

    model = torch.nn.Linear(2, 2)
    ck = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "ck", saving=rtrain.Saving(
        async_mode="off"))
    assert (ck.restore(), ck.resumed_step) == (0, None)
    ck.save(7)
    ck.close()
    again = rtrain.Checkpointer(model=model, ckpt_dir=tmp_path / "ck")
    assert (again.restore(), again.resumed_step) == (7, 7)
    again.close()


@pytest.mark.slow
def test_the_helpers_import_no_tracker_nor_torch_until_called(tmp_path):
    """A script that uses one tracker pays for no other: `import rtrain.trackers`, a Restarts
    and a restart written to a callable import none of them."""
    import subprocess
    import sys

    from harness import REPO, child_env

    code = ("import sys\nfrom rtrain import trackers\n"
            "r = trackers.fold([{'kind': 'recovery', 'attempt': 1, 'failed_attempt': 0,"
            " 'failure': 'crash'}], 1, -1)\n"
            "trackers.write(lambda r: print(r.sentence()), r, 3)\ntrackers.Restarts().poll()\n"
            "loaded = {'wandb', 'mlflow', 'tensorboard', 'tensorboardX', 'torch'} & set("
            "sys.modules)\nassert not loaded, loaded\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=child_env(PYTHONPATH=str(REPO)), timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "after attempt 0 crash" in r.stdout
