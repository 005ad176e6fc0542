"""Memory pressure in the watch loop against a real worker child, with a scripted GPU filling
up: the relieve request reaches the child and is answered, and persisting pressure stops it at
a step boundary as a memory failure; pressure that goes away stops nothing."""

from __future__ import annotations

import pytest
from harness import child_spec

from rtrain.supervisor.config import Config, PressureConfig
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading, ScriptedReader
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.watch import WatchConfig, watch

GIB = 1 << 30
CONFIG = WatchConfig.from_config(Config(
    sample_interval_s=0.05, grace_s=5,
    pressure=PressureConfig(gpu_fraction=0.9, sustain_s=0.3)))


def gpu(used_gib: float) -> GpuReading:
    return GpuReading(devices=(DeviceMemory(0, int(used_gib * GIB), 80 * GIB),))


def _watch(tmp_path, reader):
    notes = []
    attempt = tmp_path / "attempts" / "0"
    with HeartbeatReceiver() as hbs:
        env = {"RTRAIN_HEARTBEAT": hbs.name, "RTRAIN_STATUS": str(attempt)}
        child = spawn(child_spec(tmp_path, "runtime_heartbeats.py", "pressure", env=env))
        try:
            outcome = watch(child, CONFIG, heartbeats=hbs, gpu=reader,
                            on_pressure=notes.append)
        finally:
            child.close()
    return outcome, notes, (attempt / "stdout.log").read_text()


@pytest.mark.slow
def test_a_gpu_that_stays_full_stops_the_child_for_a_rung_down(tmp_path):
    # 10 samples at 40 GiB, then 78 of 80 GiB (97%) for good
    outcome, notes, out = _watch(tmp_path, ScriptedReader([gpu(40)] * 10 + [gpu(78)]))
    ev = outcome.seen
    # above the line: rising at once (room made where it costs nothing), then the acts
    assert [n.action for n in notes] == ["rising", "relieve", "degrade"]
    assert notes[1].reading.source == "gpu0" and notes[1].reading.used == 78 * GIB
    assert "relieved at step" in out  # the request reached the worker and was answered
    assert ev.returncode == 75 and ev.stop_confirmed and not ev.killed_after_grace
    assert ev.pressure_stop.startswith("GPU0 at 79872 MiB of 81920 MiB (98%")
    assert ev.stop_requested is None  # not a stop from outside: the launch goes on
    failure = classify(ev, memory_pressure_fraction=0.9)
    assert failure.kind is FailureKind.MEMORY_PRESSURE and "no step lost" in failure.reason
    assert ev.last_step is not None and f"at step {ev.last_step}" in failure.reason


@pytest.mark.slow
def test_pressure_that_goes_away_after_relief_stops_nothing(tmp_path):
    # full for 0.5 s (relief is asked after 0.3 s), then back to half
    reader = ScriptedReader([gpu(40)] * 10 + [gpu(78)] * 10 + [gpu(40)])
    outcome, notes, out = _watch(tmp_path, reader)
    assert [n.action for n in notes] == ["rising", "relieve"]
    assert "relieved at step" in out
    ev = outcome.seen
    assert ev.returncode == 0 and ev.pressure_stop is None and ev.last_step == 100
