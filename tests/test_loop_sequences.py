"""The failure path's sequences through the real launch loop with a scripted child
(scripted_loop.py): what the watch saw goes to `judge`, the loop writes what it returns in order,
then acts. Each case asserts the whole event sequence and that the terminal hears the attempt's
end before the action taken on it."""

from __future__ import annotations

from scripted_loop import Script, run, success

from rtrain.supervisor.decide.observation import Heartbeats, Observation
from rtrain.supervisor.records.runstate import RunStatus, load_state


def kinds(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events]


def index(said: list[str], start: str) -> int:
    [i] = [n for n, line in enumerate(said) if line.startswith(start)]
    return i


def test_a_start_up_failure_is_recorded_then_the_run_gives_up(tmp_path):
    broken = Observation(returncode=1, duration_s=1.0,
                         stderr_tail="ModuleNotFoundError: No module named 'tarin'\n")
    script = Script([broken])
    code, events = run(tmp_path, script)
    assert code == 3 and len(script.spawned) == 1
    assert kinds(events) == ["launch", "exit", "classification", "decision", "give_up"]
    assert events[2]["failure"] == "startup"
    assert index(script.said, "attempt 0 failed: startup") < index(script.said, "giving up")
    assert load_state(tmp_path / "run").status is RunStatus.GAVE_UP


def test_a_confirmed_stop_is_recorded_with_its_signal_then_exits_75(tmp_path):
    stopped = Observation(returncode=75, stop_requested="SIGTERM", signals=("SIGTERM",),
                          last_step=140, heartbeats=Heartbeats(count=3, last_event="stop",
                                                               last_step=140))
    script = Script([stopped])
    code, events = run(tmp_path, script)
    assert code == 75
    assert kinds(events) == ["launch", "signal", "exit", "heartbeat_summary", "classification",
                             "decision"]
    assert events[1]["name"] == "SIGTERM" and events[4]["failure"] == "preempted"
    assert events[5]["action"] == "exit_preempted"
    assert index(script.said, "attempt 0 failed: preempted") < index(script.said, "stopped: ")
    assert load_state(tmp_path / "run").status is RunStatus.PREEMPTED


def test_an_oom_is_recorded_with_its_rung_before_the_relaunch(tmp_path):
    oom = Observation(returncode=1, last_step=7,
                      stderr_tail="torch.OutOfMemoryError: CUDA out of memory\n")
    script = Script([oom, success()])
    code, events = run(tmp_path, script, settings={"batch_size": 16, "grad_accum": 1})
    assert code == 0
    # The relaunch starts fresh (nothing was saved): said once, before it (cannot_resume).
    assert kinds(events) == ["launch", "exit", "classification", "decision", "degrade",
                             "cannot_resume", "launch", "exit", "decision", "finished"]
    said = script.said
    # recorded (the failure, the rung), then acted on (the reason, the wait), then relaunched
    assert (index(said, "attempt 0 failed: oom_gpu") < index(said, "degrading: ")
            < index(said, events[3]["reason"]) < index(said, "attempt 1: launched"))
    assert script.backoffs == [events[3]["backoff_s"]]
    assert script.spawned[1].spec.env["RTRAIN_SETTINGS"] == '{"batch_size": 8, "grad_accum": 2}'


def test_a_device_that_failed_its_health_checks_is_recorded_before_the_classification(
        tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # no Slurm: relaunched here, no slurm field
    failed = {"index": 0, "reachable": False, "error": "GPU is lost"}
    lost = Observation(returncode=-9, last_step=3, failed_devices=(failed,),
                       failed_detail="GPU 0: unreachable (GPU is lost)")
    script = Script([lost, success()])
    code, events = run(tmp_path, script)
    assert code == 0
    assert kinds(events) == ["launch", "exit", "device_failed", "classification", "decision",
                             "cannot_resume", "launch", "exit", "decision", "finished"]
    assert events[2]["devices"] == [failed] and "slurm" not in events[2]
    assert events[3]["failure"] == "lost_device"
    assert "GPU 0: unreachable (GPU is lost)" in events[3]["reason"]
    assert events[1]["signal"] == "SIGKILL" and events[1]["returncode"] is None
