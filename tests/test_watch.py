"""The watch loop against real children: exits, signals, hangs, heartbeats, the GPU reader."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest
from harness import child_spec, gone, wait_for

from rtrain.supervisor.config import Config
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading, ScriptedReader
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.supervisor.proc.signals import SignalCatcher
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.watch import WatchConfig, watch


def watch_config(*, hang=None, **changes):
    """What `rtrain launch` watches with by default (config.Config), with these changes;
    `hang` holds changes to its HangPolicy."""
    base = WatchConfig.from_config(Config())
    return replace(base, hang=replace(base.hang, **(hang or {})), **changes)


FAST = watch_config(
    sample_interval_s=0.1,
    grace_s=5,
    hang_grace_s=0.5,
    dump_timeout_s=5,
    hang={"plain_timeout_s": 30},
)
GiB = 1 << 30


def _watch(tmp_path, script, *args, config=FAST, env=None, **kw):
    receiver = kw.pop("heartbeats", None)
    if receiver is not None:
        env = {
            **(env or {}),
            "RTRAIN_HEARTBEAT": receiver.name,
            "RTRAIN_STATUS": str(tmp_path / "attempts" / "0"),
        }
    spec = child_spec(tmp_path, script, *args, env=env or {})
    child = spawn(spec)
    try:
        return watch(child, config, heartbeats=receiver, **kw), child
    finally:
        child.close()


@pytest.mark.slow
def test_crash_exit_code_stderr_and_exit_record(tmp_path):
    attempt = tmp_path / "attempts" / "0"
    attempt.mkdir(parents=True)
    (attempt / "exit-rank0.json").write_text(
        '{"kind": "data", "reason": "too many bad samples", "pid": 1, "v": 1}'
    )
    outcome, child = _watch(tmp_path, "crash_with_code.py", "3")
    ev = outcome.seen
    assert ev.returncode == 3 and ev.signal is None and ev.pid == child.pid
    assert "RuntimeError: boom" in ev.stderr_tail
    assert [r["kind"] for r in ev.exit_records] == ["data"]
    assert not ev.hang and ev.stop_requested is None and not ev.stop_confirmed
    # No heartbeats and no start-up error in stderr: a plain script that got past start-up.
    assert ev.first_step_seen
    assert ev.host_mem_total and ev.duration_s > 0


@pytest.mark.slow
def test_leftover_grandchildren_are_swept_after_exit(tmp_path):
    pids_file = tmp_path / "pids"
    outcome, _ = _watch(tmp_path, "leave_grandchildren.py", str(pids_file))
    inside, escaped = map(int, wait_for(pids_file).split())
    assert outcome.seen.returncode == 0
    assert outcome.stop.leftovers == []
    assert gone(inside, 0.5) and gone(escaped, 0.5)


@pytest.mark.slow
def test_signal_to_supervisor_forwards_stop_and_child_exits_75(tmp_path):
    sent = []

    def on_heartbeat(hb):
        if hb.step and hb.step >= 3 and not sent:
            sent.append(hb.step)
            os.kill(os.getpid(), signal.SIGUSR1)  # as Slurm's --signal=B:USR1 would

    with HeartbeatReceiver() as receiver:
        outcome, _ = _watch(
            tmp_path, "runtime_heartbeats.py", "preempt", heartbeats=receiver,
            on_heartbeat=on_heartbeat,
        )
    ev = outcome.seen
    assert ev.returncode == 75
    assert ev.stop_requested == "SIGUSR1" and outcome.seen.signals == ("SIGUSR1",)
    assert outcome.stop.signal_sent == "SIGTERM" and not ev.killed_after_grace
    assert ev.first_step_seen and ev.last_step is not None and ev.last_step >= 3
    assert outcome.seen.heartbeats.last_event == "stop"
    assert outcome.seen.heartbeats.samples_per_s and outcome.seen.heartbeats.last_loss is not None
    # handlers are restored once watch returns
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


@pytest.mark.slow
def test_refused_control_requests_are_no_progress_and_leave_the_stop_confirmed(tmp_path):
    seen = []
    with HeartbeatReceiver() as receiver:
        outcome, _ = _watch(tmp_path, "runtime_heartbeats.py", "preempt_refused",
                            heartbeats=receiver, stop_at=time.monotonic() + 1.0, stop_why="test",
                            on_heartbeat=lambda hb: seen.append(hb.event))
    ev = outcome.seen
    assert ev.returncode == 75 and ev.stop_confirmed  # its last word was still `stop`
    assert outcome.seen.heartbeats.last_event == "stop"
    assert seen[-1] == "control_refused" and "control_refused" in seen  # still reported


@pytest.mark.slow
def test_stop_escalates_to_sigkill_after_grace(tmp_path):
    def on_sample(sample):
        ready = (tmp_path / "attempts/0/stdout.log").read_text() == "ready\n"
        if ready and not catcher.pending and not fired:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGTERM)

    fired: list = []
    config = watch_config(sample_interval_s=0.2, grace_s=0.5)
    with SignalCatcher() as catcher:
        outcome, _ = _watch(
            tmp_path, "ignore_sigterm.py", config=config, signals=catcher, on_sample=on_sample
        )
    ev = outcome.seen
    assert ev.signal == "SIGKILL" and ev.killed_after_grace and ev.stop_requested == "SIGTERM"


@pytest.mark.slow
def test_second_sigint_kills_at_once(tmp_path):
    def on_sample(sample):
        ready = (tmp_path / "attempts/0/stdout.log").read_text() == "ready\n"
        if ready and len(fired) < 2:
            fired.append(1)
            os.kill(os.getpid(), signal.SIGINT)

    fired: list = []
    config = watch_config(sample_interval_s=0.1, grace_s=600)  # would take 10 min without it
    outcome, _ = _watch(tmp_path, "ignore_sigterm.py", config=config, on_sample=on_sample)
    assert outcome.hard_stop and outcome.seen.signals == ("SIGINT", "SIGINT")
    assert outcome.seen.signal == "SIGKILL" and not outcome.seen.killed_after_grace


@pytest.mark.slow
def test_plain_script_hang_dumps_stacks_then_stops(tmp_path):
    config = watch_config(sample_interval_s=0.1, hang_grace_s=2, hang={"plain_timeout_s": 0.6})
    outcome, child = _watch(tmp_path, "hang.py", config=config)
    ev = outcome.seen
    assert ev.hang and "no output and no CPU progress" in ev.hang_detail
    assert ev.signal == "SIGTERM"  # a plain script dies of the polite signal
    _assert_pyspy_stack(outcome, child)


@pytest.mark.slow
def test_sigstopped_child_is_a_hang(tmp_path):
    config = watch_config(sample_interval_s=0.1, hang_grace_s=2, hang={"plain_timeout_s": 0.6})
    outcome, child = _watch(tmp_path, "hang.py", "stop", config=config)
    ev = outcome.seen
    assert ev.hang and ev.signal == "SIGTERM"  # SIGCONT after SIGTERM lets it act on it
    _assert_pyspy_stack(outcome, child)


def _assert_pyspy_stack(outcome, child):
    path = child.spec.attempt_dir / f"stacks-pyspy-{child.pid}.txt"
    assert path in outcome.stack_files
    text = path.read_text()
    assert "stuck_here" in text or "Error" in text  # py-spy may lack ptrace rights elsewhere


@pytest.mark.slow
def test_learned_timeout_catches_silent_worker(tmp_path):
    hang = {"startup_s": 20, "warmup_steps": 2, "multiple": 4, "floor_s": 0.5, "ceiling_s": 3}
    config = watch_config(sample_interval_s=0.1, hang_grace_s=0.5, hang=hang)
    with HeartbeatReceiver() as receiver:
        outcome, child = _watch(
            tmp_path, "runtime_heartbeats.py", "silent", config=config, heartbeats=receiver
        )
    ev = outcome.seen
    assert ev.hang and "learned" in ev.hang_detail, ev.hang_detail
    assert ev.first_step_seen and ev.last_step and ev.last_step >= 10
    # the worker handles SIGTERM by setting a flag it never reads while hung: SIGKILL follows
    assert ev.signal == "SIGKILL" and ev.killed_after_grace
    stacks = child.spec.attempt_dir / f"stacks-{child.pid}.txt"
    assert "time.sleep" in stacks.read_text() or "runtime_heartbeats.py" in stacks.read_text()


@pytest.mark.slow
def test_a_save_at_the_hang_that_has_begun_outlives_the_grace(tmp_path):
    # The save takes 2 s, four times the hung child's grace: its save_begin moves the SIGKILL
    # to the save allowance, and its hang_save_done ends the wait.
    hang = {"startup_s": 20, "warmup_steps": 2, "multiple": 4, "floor_s": 0.5, "ceiling_s": 3,
            "save_allowance_s": 30}
    config = watch_config(sample_interval_s=0.1, hang_grace_s=0.5, hang=hang)
    with HeartbeatReceiver() as receiver:
        outcome, child = _watch(tmp_path, "runtime_heartbeats.py", "slow_hang_save", "2",
                                config=config, heartbeats=receiver,
                                env={"RTRAIN_CONTROL_TOKEN": "ab" * 16})
    ev = outcome.seen
    assert ev.hang and ev.signal == "SIGKILL"
    assert (child.spec.attempt_dir / "saved").read_text() == "step 20"
    assert outcome.seen.heartbeats.last_event == "hang_save_done"
    # killed at the save's end, not the grace's or the allowance's
    assert 2 <= outcome.seen.stop_s < 20


@pytest.mark.slow
def test_gpu_filling_up_then_lost(tmp_path):
    readings = [GpuReading((DeviceMemory(0, used * GiB, 80 * GiB),)) for used in (10, 40, 79)]
    readings.append(
        GpuReading((DeviceMemory(0, 79 * GiB, 80 * GiB),), lost=True, detail="GPU 0: GPU is lost")
    )
    reader = ScriptedReader(readings)
    samples = []
    outcome, _ = _watch(tmp_path, "hang.py", gpu=reader, on_sample=samples.append)
    ev = outcome.seen
    assert ev.device_lost and ev.device_detail == "GPU 0: GPU is lost"
    assert ev.gpu_mem_used_peak == 79 * GiB and ev.gpu_mem_total == 80 * GiB
    assert ev.signal == "SIGTERM" and not ev.hang
    assert [s.gpu.devices[0].used // GiB for s in samples[:3]] == [10, 40, 79]


@pytest.mark.slow
def test_failing_callback_stops_the_child_and_propagates(tmp_path):
    seen = []

    def on_sample(sample):
        seen.extend(sample.tree.pids)
        raise RuntimeError("status line broke")

    with pytest.raises(RuntimeError, match="status line broke"):
        _watch(
            tmp_path, "ignore_sigterm.py", config=watch_config(hang_grace_s=0.2),
            on_sample=on_sample,
        )
    assert seen and all(gone(pid, 2) for pid in seen)
