"""`bad_checkpoint`: named from the exit record, decided as a relaunch without a per-kind budget,
remembered in state.json (pure parts; the end-to-end runs are in test_hostile_launch.py)."""

from __future__ import annotations

from observed import observed

from rtrain.supervisor.config import Config, RestartConfig
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.policy import Action, History, decide
from rtrain.supervisor.records.runstate import RunState, load_state, save_state

BAD = {"kind": "bad_checkpoint", "reason": "checkpoint-8: cannot load: model.safetensors: content "
       "hash does not match the manifest", "rank": 1, "time": 2.0,
       "extra": {"checkpoint": "/ckpt/checkpoint-8"}}


def test_the_record_names_the_attempt_over_what_other_ranks_report():
    crash = {"kind": "crash", "reason": "collective failed", "rank": 0, "time": 1.0}
    oom = {"kind": "oom_gpu", "reason": "CUDA out of memory", "rank": 2, "time": 3.0}
    f = classify(observed(returncode=1, exit_records=[crash, BAD, oom]),
                 memory_pressure_fraction=Config().memory_pressure_fraction)
    assert f.kind is FailureKind.BAD_CHECKPOINT
    assert f.reason.startswith("rank 1: checkpoint-8: cannot load: model.safetensors")


def test_exit_65_without_a_record_is_not_a_bad_checkpoint():
    f = classify(observed(returncode=65, first_step_seen=True, stderr_tail="bye"),
                 memory_pressure_fraction=Config().memory_pressure_fraction)
    assert f.kind is FailureKind.CRASH


def test_relaunch_at_once_counting_toward_max_restarts_only():
    failure = Failure(kind=FailureKind.BAD_CHECKPOINT, reason="checkpoint-8: cannot load",
                      seen=observed(returncode=65, exit_records=[BAD]))
    h = History(attempt=2, budgets_used={"crash": 3}, total_restarts=4, launch_step=8,
                stalled=(8, 8))
    d = decide(failure, h, Config(), rand=0.9, newest_step=8)
    assert d.action is Action.RELAUNCH and d.backoff_s == 0.0
    assert d.history.total_restarts == 5 and d.history.budgets_used == {"crash": 3}
    assert d.history.stalled == (8, 8)  # three bad ones in a row are not a crash loop
    assert "skipping that checkpoint" in d.reason
    spent = Config(restart=RestartConfig(max_restarts=4))
    assert decide(failure, h, spent, rand=0.0, newest_step=8).action is Action.GIVE_UP


def test_skipped_checkpoints_survive_in_state_json(tmp_path):
    h = History(bad_checkpoints=("/ckpt/checkpoint-8|1790000000.5",))
    save_state(tmp_path, RunState(command=["train.py"], cwd="/", created=0.0, updated=0.0,
                                  history=h))
    assert load_state(tmp_path).history.bad_checkpoints == h.bad_checkpoints
