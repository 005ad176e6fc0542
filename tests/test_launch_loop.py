"""The launch loop in-process, with scripted attempt outcomes (as torchelastic's agent tests
script monitor results): a fake spawner and watcher stand in for the child, a fake clock and
sleepers for time. Nothing here starts a process or sleeps; the event log, state.json and the
decisions are the real ones."""

from __future__ import annotations

import signal
from dataclasses import replace

from scripted_loop import PID0, Script, crash, run, success

from rtrain.supervisor.decide.observation import Heartbeats, Observation
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading, ScriptedReader
from rtrain.supervisor.records.runstate import RunStatus, load_state


def kinds(events: list[dict]) -> list[str]:
    return [e["kind"] for e in events]


def test_crash_crash_success_relaunches_with_growing_backoff(tmp_path):
    script = Script([crash(), crash(2), success()])
    code, events = run(tmp_path, script)
    assert code == 0
    attempt_events = ["launch", "exit", "classification", "decision"]
    # The first fresh relaunch says once why there is nothing to resume from.
    assert kinds(events) == [*attempt_events, "cannot_resume", *attempt_events, "launch", "exit",
                             "decision", "finished"]
    decisions = [e for e in events if e["kind"] == "decision"]
    assert [d["action"] for d in decisions] == ["relaunch", "relaunch", "finished"]
    # The backoff doubles while attempts make no progress, and no real time passes.
    assert script.backoffs == [1.0, 2.0]
    assert [d["backoff_s"] for d in decisions[:2]] == script.backoffs
    state = load_state(tmp_path / "run")
    assert state.status is RunStatus.FINISHED
    assert state.history.budgets_used == {"crash": 2} and state.history.attempt == 2
    # Each attempt had its own number, in argv (templates) and the environment.
    assert [c.spec.argv for c in script.spawned] == [
        ["train.py", "--attempt", str(n)] for n in range(3)]
    assert [c.spec.env["RTRAIN_ATTEMPT"] for c in script.spawned] == ["0", "1", "2"]
    assert all(c.closed for c in script.spawned)
    # The failure sentence names the pid the watcher saw, not "the child".
    reasons = [e["reason"] for e in events if e["kind"] == "classification"]
    assert reasons[0].startswith(f"PID {PID0} exited with code 1")
    assert reasons[1].startswith(f"PID {PID0 + 1} exited with code 2")
    assert [e["pid"] for e in events if e["kind"] == "launch"] == [PID0, PID0 + 1, PID0 + 2]
    # Event times come from the injected wall clock: three 30 s attempts and 3 s of backoff.
    assert events[-1]["time"] - events[0]["time"] == 3 * 30.0 + 1.0 + 2.0


def test_crashes_without_progress_give_up_after_the_crash_loop(tmp_path):
    script = Script([crash()] * 10)
    code, events = run(tmp_path, script, **{"restart.crash_loop_k": 3})
    assert code == 1
    assert len(script.spawned) == 3
    assert [e["action"] for e in events if e["kind"] == "decision"] == [
        "relaunch", "relaunch", "give_up"]
    assert kinds(events)[-1] == "give_up"
    assert script.backoffs == [1.0, 2.0]  # none after the last: nothing is relaunched
    state = load_state(tmp_path / "run")
    assert state.status is RunStatus.GAVE_UP
    assert "crash loop: 3 consecutive attempts" in state.reason
    assert state.reason.startswith(f"PID {PID0 + 2} exited with code 1")


def test_the_crash_budget_gives_up_and_names_the_budget(tmp_path):
    script = Script([crash()] * 10)
    code, events = run(tmp_path, script, **{"restart.crash_loop_k": 0,
                                            "restart.budgets": {"crash": 2}})
    assert code == 1 and len(script.spawned) == 3
    assert load_state(tmp_path / "run").history.budgets_used == {"crash": 2}
    [give_up] = [e for e in events if e["kind"] == "give_up"]
    assert "the crash budget is spent (2 of 2" in give_up["reason"]
    assert load_state(tmp_path / "run").status.value == "gave_up"
    assert any("giving up" in line for line in script.said)


def test_a_stop_during_the_backoff_ends_the_run_without_another_attempt(tmp_path):
    script = Script([crash(), success()], stop_during_backoff=signal.SIGTERM)
    code, events = run(tmp_path, script)
    assert code == 75
    assert len(script.spawned) == 1 and script.backoffs == [1.0]
    assert kinds(events)[-2:] == ["decision", "signal"]
    assert events[-1]["name"] == "SIGTERM"
    state = load_state(tmp_path / "run")
    assert state.status is RunStatus.PREEMPTED
    assert state.reason == "stopped by SIGTERM during backoff"


def test_backoff_disabled_sleeps_nothing(tmp_path):
    script = Script([crash(), success()])
    code, _ = run(tmp_path, script, **{"backoff.enabled": False})
    assert code == 0 and script.backoffs == [] and script.sleeps == []


def test_gpu_memory_still_held_is_waited_for_on_the_injected_clock(tmp_path):
    held = GpuReading(devices=(DeviceMemory(0, 1 << 30, 80 << 30),),
                      process_memory={PID0: 1 << 30})
    script = Script([crash(), success()])
    code, events = run(tmp_path, script, gpu=ScriptedReader([held]),
                       gpu_release_wait_s=2.0)
    assert code == 0
    # Polled every 0.1 s on the fake clock until the 2 s ran out: no real sleeping.
    assert script.sleeps and abs(sum(script.sleeps) - 2.0) < 0.11
    [late] = [e for e in events if e["kind"] == "gpu_not_released"]
    assert late["pids"] == [PID0]
    assert kinds(events).index("gpu_not_released") < kinds(events).index("launch", 1)


def test_a_finished_run_is_not_relaunched_unless_fresh(tmp_path):
    script = Script([success()])
    assert run(tmp_path, script)[0] == 0
    again = Script([success()])
    code, _ = run(tmp_path, again)
    assert code == 0 and again.spawned == []
    assert any("already finished" in line for line in again.said)
    fresh = Script([success()])
    code, events = run(tmp_path, fresh, fresh=True)
    assert code == 0 and len(fresh.spawned) == 1
    assert [e["attempt"] for e in events if e["kind"] == "launch"] == [0, 0]


GIB = 1 << 30


def test_a_pressure_stop_relaunches_one_rung_down_and_records_the_rungs_peak(tmp_path):
    why = "the run's cgroup at 900 MiB of 1024 MiB (88%, threshold 75%)"
    stopped = Observation(returncode=75, heartbeats=Heartbeats(last_event="stop"), last_step=140,
                          pressure_stop=why, peak_rss_bytes=950 << 20, host_mem_limit=GIB)
    script = Script([stopped, success()])
    code, events = run(tmp_path, script, settings={"batch_size": 16, "grad_accum": 1})
    assert code == 0
    [cls] = [e for e in events if e["kind"] == "classification"]
    assert cls["failure"] == "memory_pressure" and "no step lost" in cls["reason"]
    assert [c.spec.env["RTRAIN_SETTINGS"] for c in script.spawned] == [
        '{"batch_size": 16, "grad_accum": 1}', '{"batch_size": 8, "grad_accum": 2}']
    assert script.spawned[0].spec.env["RTRAIN_RELIEVE_SIGNAL"] == "SIGURG"
    history = load_state(tmp_path / "run").history
    assert history.budgets_used == {"oom": 1}
    assert history.rung_peaks["0"] == {"host": 950 << 20, "host_limit": GIB}


def test_the_climb_back_waits_until_the_rung_above_fits(tmp_path):
    def attempt(ev_kind, gpu_total):
        seen = crash() if ev_kind == "crash" else Observation(
            returncode=1, stderr_tail="torch.OutOfMemoryError: CUDA out of memory\n")
        return replace(seen, last_step=600, peak_rss_bytes=GIB, host_mem_limit=16 * GIB,
                       gpu_mem_used_peak=79 * GIB, gpu_mem_total=gpu_total)

    # rung 0 ran out of an 80 GiB GPU; rung 1 trains 600 healthy steps, crashes: the 79 GiB
    # rung 0 does not fit 80 GiB; after 600 more it runs on a 160 GiB GPU: it fits, climb.
    script = Script([attempt("oom", 80 * GIB), attempt("crash", 80 * GIB),
                     attempt("crash", 160 * GIB), success()])
    code, events = run(tmp_path, script, settings={"batch_size": 16, "grad_accum": 1})
    assert code == 0
    levels = [e["level"] for e in events if e["kind"] == "launch"]
    assert levels == [0, 1, 1, 0]
    reasons = [e["reason"] for e in events if e["kind"] == "decision"]
    assert "the rung above does not fit (GPU peak 80896 MiB of 81920 MiB" in reasons[1]
    assert "climbing back one rung after 500 healthy steps" in reasons[2]
