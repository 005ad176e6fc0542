"""Memory pressure, pure parts by table: when relief is asked and when the stop for a rung
down comes by the hard line (pressure/decide.py; the trend rule: tests/test_pressure_trend.py),
what acting takes as the heartbeats measure it and which memory is measured
(pressure/monitor.py, cgroup.py), how the stop is classified, whether a rung fits to climb
back, and the worker's answer to a relieve request (worker/runtime.py, OOMBackoff). The real
ones: tests/test_chaos_pressure.py (a cgroup limit) and tests/test_watch_pressure.py (a
scripted GPU filling up)."""

from __future__ import annotations

import gc

import pytest
from observed import observed

from rtrain.supervisor.config import PressureConfig
from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.decide.classify import classify
from rtrain.supervisor.decide.failures import FailureKind
from rtrain.supervisor.pressure.decide import (
    PRIOR_SAVE_S,
    PRIOR_STEP_S,
    Act,
    MemoryReading,
    PressureState,
    Rule,
    Timings,
    advance,
    answered,
    climb_fits,
    rung_peak,
    worst,
)
from rtrain.supervisor.pressure.monitor import _Durations, host_reading, readings
from rtrain.supervisor.proc.cgroup import MemoryCgroup
from rtrain.supervisor.proc.gpu import DeviceMemory, GpuReading
from rtrain.supervisor.proc.proctree import TreeSample
from rtrain.worker import runtime

MIB, GIB = 1 << 20, 1 << 30


def host(used_gib: float, fraction: float = 0.9) -> MemoryReading:
    return MemoryReading("host", int(used_gib * GIB), 10 * GIB, fraction)


# ------------------------------------------------------------------ advance: relieve, degrade


def run(samples: list[tuple[float, float | None]], sustain_s: float = 5.0,
        answers: tuple[float, ...] = ()) -> list[tuple[float, Act]]:
    """Feed (time, host GiB used of 10; None: no reading) samples; the acts that came out."""
    state, acts = PressureState(), []
    for now, used in samples:
        if now in answers:
            state = answered(state, now)
        found = [] if used is None else [host(used)]
        state, verdict = advance(state, found, now, Rule(sustain_s=sustain_s, interval_s=1.0))
        if verdict.act is not Act.NONE:
            acts.append((now, verdict.act))
    return acts


@pytest.mark.parametrize(("samples", "acts"), [
    # under the 9 GiB line: nothing
    ([(t, 8.9) for t in range(20)], []),
    # above for 5 s: relieve; above 5 s more: degrade, once
    ([(t, 9.5) for t in range(20)], [(5, Act.RELIEVE), (10, Act.DEGRADE)]),
    # exactly at the line counts
    ([(t, 9.0) for t in range(11)], [(5, Act.RELIEVE), (10, Act.DEGRADE)]),
    # a spike shorter than the window: nothing
    ([(0, 9.5), (1, 9.5), (2, 9.5), (3, 5.0), (4, 9.5), (5, 9.5), (6, 5.0)], []),
    # relief worked (below the line), pressure came back: relief again, no degrade yet
    ([(t, 9.5) for t in range(6)] + [(6, 5.0)] + [(t, 9.5) for t in range(7, 13)],
     [(5, Act.RELIEVE), (12, Act.RELIEVE)]),
    # a missing reading is no pressure
    ([(t, 9.5) for t in range(5)] + [(5, None)] + [(t, 9.5) for t in range(6, 12)],
     [(11, Act.RELIEVE)]),
])
def test_relieve_then_degrade_only_while_it_lasts(samples, acts):
    assert run(samples) == acts


def test_the_second_window_counts_from_the_workers_answer():
    samples = [(t, 9.5) for t in range(20)]
    # asked at 5; the worker answers at 8 (its step ended then): the stop is due at 13, not 10
    assert run(samples, answers=(8,)) == [(5, Act.RELIEVE), (13, Act.DEGRADE)]
    # an answer before any request, or after the degrade, changes nothing
    assert answered(PressureState(), 3.0) == PressureState()
    done = PressureState(over_since=0, relieved_at=5, degraded=True)
    assert answered(done, 11.0) == done


def test_sustain_zero_acts_on_consecutive_samples():
    assert run([(0, 9.5), (1, 9.5), (2, 9.5)], sustain_s=0) == [(0, Act.RELIEVE),
                                                                 (1, Act.DEGRADE)]


@pytest.mark.parametrize(("found", "source"), [
    ([], None),
    ([host(5.0)], "host"),
    # GPU at 95% of its 0.98 line beats host at 80% of its 0.9 line
    ([host(7.2), MemoryReading("gpu0", 95, 100, 0.98)], "gpu0"),
    ([host(8.9), MemoryReading("gpu0", 95, 100, 0.98)], "host"),
    # a fraction of 0 is not watched, however full
    ([host(1.0), MemoryReading("gpu0", 100, 100, 0.0)], "host"),
    ([MemoryReading("gpu0", 0, 0, 0.98)], None),  # no limit known
])
def test_worst_is_the_one_nearest_its_own_line(found, source):
    w = worst(found)
    assert (w.source if w else None) == source


def test_a_reading_says_what_it_is():
    r = MemoryReading("cgroup", 800 * MIB, 1024 * MIB, 0.75)
    assert r.over and r.describe() == ("the run's cgroup at 800 MiB of 1024 MiB (78%, "
                                       "threshold 75%)")
    assert not MemoryReading("gpu1", 1, 2, 0.0).over
    assert MemoryReading("gpu1", 1, 2, 0.5).describe().startswith("GPU1 at")


# ------------------------------------------------------------------ what is measured


def _cgroup(tmp_path, version, limit, usage, inactive):
    if version == 1:
        (tmp_path / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (tmp_path / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (tmp_path / "memory.stat").write_text(f"cache 5\nrss 7\ntotal_inactive_file {inactive}\n")
    else:
        (tmp_path / "memory.max").write_text(f"{limit}\n")
        (tmp_path / "memory.current").write_text(f"{usage}\n")
        (tmp_path / "memory.stat").write_text(f"anon 7\ninactive_file {inactive}\n")
    return MemoryCgroup(tmp_path, version)


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limit_and_working_set(tmp_path, version):
    group = _cgroup(tmp_path, version, 1 * GIB, 900 * MIB, 300 * MIB)
    assert group.limit() == GIB
    assert group.working_set() == 600 * MIB  # the inactive page cache is reclaimed first


@pytest.mark.parametrize(("version", "unlimited"), [(1, 9223372036854771712), (2, "max")])
def test_a_cgroup_without_a_limit_has_none(tmp_path, version, unlimited):
    assert _cgroup(tmp_path, version, unlimited, 1, 0).limit() is None
    assert MemoryCgroup(tmp_path / "gone", version).limit() is None
    assert MemoryCgroup(tmp_path / "gone", version).working_set() is None


def tree(available_gib: float, total_gib: float = 16) -> TreeSample:
    return TreeSample(0.0, (1,), GIB, 1.0, True, int(available_gib * GIB), int(total_gib * GIB))


def test_host_memory_is_the_cgroups_when_it_has_a_limit(tmp_path):
    group = _cgroup(tmp_path, 1, 2 * GIB, 1900 * MIB, 100 * MIB)
    r = host_reading(group, tree(12), 0.9)
    assert (r.source, r.used, r.limit) == ("cgroup", 1800 * MIB, 2 * GIB)
    # no limit, or one above the machine's memory: the machine's total minus available
    for g in (None, _cgroup(tmp_path, 1, 9223372036854771712, 1, 0)):
        r = host_reading(g, tree(12), 0.9)
        assert (r.source, r.used, r.limit) == ("host", 4 * GIB, 16 * GIB)


def test_readings_cover_the_host_and_every_gpu():
    gpu = GpuReading(devices=(DeviceMemory(0, 10, 80), DeviceMemory(1, 79, 80)))
    found = readings(None, tree(12), gpu, PressureConfig(fraction=0.8, gpu_fraction=0.95))
    assert [(r.source, r.used, r.limit, r.fraction) for r in found] == [
        ("host", 4 * GIB, 16 * GIB, 0.8), ("gpu0", 10, 80, 0.95), ("gpu1", 79, 80, 0.95)]


# ------------------------------------------------------------------ classification

WHY = "the run's cgroup at 800 MiB of 1024 MiB (78%, threshold 75%)"


@pytest.mark.parametrize(("ev", "kind", "words"), [
    (observed(returncode=75, pressure_stop=WHY, last_step=140, stop_confirmed=True),
     FailureKind.MEMORY_PRESSURE, "committed a checkpoint at step 140 and exited (no step lost)"),
    # under torchrun: the agent's status is not 75, the workers confirmed the stop
    (observed(returncode=1, pressure_stop=WHY, stop_confirmed=True),
     FailureKind.MEMORY_PRESSURE, "no step lost"),
    (observed(signal="SIGKILL", pressure_stop=WHY, killed_after_grace=True),
     FailureKind.MEMORY_PRESSURE, "did not save within the grace and was killed"),
    (observed(signal="SIGTERM", pressure_stop=WHY), FailureKind.MEMORY_PRESSURE,
     "without confirming a checkpoint"),
    # the kernel was faster than the stop: its kill names the failure
    (observed(signal="SIGKILL", pressure_stop=WHY, cgroup_oom_kills=1),
     FailureKind.OOM_HOST, "OOM killer"),
    # the same exit 75 without a pressure stop is a preemption
    (observed(returncode=75, stop_confirmed=True), FailureKind.PREEMPTED, "exit 75"),
])
def test_a_pressure_stop_is_a_memory_failure(ev, kind, words):
    failure = classify(ev, memory_pressure_fraction=0.9)
    assert failure.kind is kind and words in failure.reason
    if kind is FailureKind.MEMORY_PRESSURE:
        assert failure.reason.startswith(f"stopped by rtrain under memory pressure ({WHY})")


# ------------------------------------------------------------------ climbing back


def test_rung_peak_keeps_the_largest_footprint_and_the_newest_limits():
    assert rung_peak(None, host=0, host_limit=None, gpu=None, gpu_limit=None) is None
    p = rung_peak(None, host=3 * GIB, host_limit=16 * GIB, gpu=None, gpu_limit=None)
    assert p == {"host": 3 * GIB, "host_limit": 16 * GIB}
    p = rung_peak(p, host=2 * GIB, host_limit=32 * GIB, gpu=70 * GIB, gpu_limit=80 * GIB)
    assert p == {"host": 3 * GIB, "host_limit": 32 * GIB, "gpu": 70 * GIB, "gpu_limit": 80 * GIB}


@pytest.mark.parametrize(("peak", "host_limit", "gpu_limit", "fits", "words"), [
    (None, GIB, None, False, "no memory peak was recorded"),
    ({}, GIB, None, False, "no memory peak was recorded"),
    ({"host": 700 * MIB}, None, None, False, "no host memory limit is known"),
    ({"host": 819 * MIB, "host_limit": GIB}, None, None, True, "fit with 10% headroom"),
    ({"host": 820 * MIB, "host_limit": GIB}, None, None, False, "above 80% of it"),
    ({"host": 820 * MIB, "host_limit": GIB}, 2 * GIB, None, True, "of 2048 MiB"),
    # the GPU is checked against gpu_fraction (0.98) - headroom
    ({"host": MIB, "host_limit": GIB, "gpu": 70 * GIB, "gpu_limit": 80 * GIB}, None, None,
     True, "GPU peak 71680 MiB"),
    ({"host": MIB, "host_limit": GIB, "gpu": 71 * GIB, "gpu_limit": 80 * GIB}, None, None,
     False, "GPU peak"),
])
def test_climb_fits_by_the_recorded_peak(peak, host_limit, gpu_limit, fits, words):
    ok, why = climb_fits(peak, host_limit=host_limit, gpu_limit=gpu_limit, fraction=0.9,
                         gpu_fraction=0.98, headroom=0.1)
    assert ok is fits and words in why


# ------------------------------------------------------------------ the worker's answer


@pytest.fixture
def fresh_runtime(monkeypatch):
    monkeypatch.setattr(runtime, "_state", runtime._State())
    return runtime


def test_a_relieve_request_runs_the_callbacks_at_the_next_boundary(fresh_runtime):
    rt = fresh_runtime
    calls = []
    rt.on_pressure(lambda: calls.append("a") or "freed a")
    assert rt.relieve_pressure(1) is None and calls == []  # no request: nothing runs
    rt._on_relieve_signal(0, None)  # what the handler does: a flag, nothing else
    assert rt.pressure_requested() and calls == []
    done = rt.relieve_pressure(2)
    assert calls == ["a"] and done[0] == "freed a" and done[-1].startswith("gc collected")
    assert not rt.pressure_requested() and rt.relieve_pressure(3) is None


def test_a_failing_or_dead_callback_does_not_stop_relief(fresh_runtime):
    rt = fresh_runtime

    class Cache:
        def clear(self) -> str:
            return "cleared"

    def broken() -> str:
        raise RuntimeError("boom")

    cache = Cache()
    rt.on_pressure(broken)
    rt.on_pressure(cache.clear)
    rt.on_pressure(cache.clear)  # registered once
    rt._on_relieve_signal(0, None)
    assert rt.relieve_pressure(1)[:1] == ["cleared"]
    del cache
    gc.collect()
    rt._on_relieve_signal(0, None)
    assert rt.relieve_pressure(2)[:1] != ["cleared"]  # held weakly: gone with its object
    assert len(rt._state.on_pressure) == 1  # and dropped from the list


def test_oom_backoff_steps_its_micro_batch_down_on_relief(fresh_runtime, monkeypatch):
    import torch

    from rtrain.worker.guards import degrade

    monkeypatch.setattr(degrade, "_overrides", {})
    backoff = degrade.OOMBackoff(settings={"batch_size": 16, "grad_accum": 1})
    w = torch.zeros(4, requires_grad=True)
    backoff.run(lambda mb: (mb @ w).mean(), torch.ones(16, 4))
    fresh_runtime._on_relieve_signal(0, None)
    done = fresh_runtime.relieve_pressure(1)
    assert "micro-batch 16 -> 8" in done
    assert backoff.micro == 8
    assert degrade.effective_settings({}) == {"batch_size": 8, "grad_accum": 2}
    # the next batch runs as two micro-batches, the same gradient
    w.grad = None
    backoff.run(lambda mb: (mb @ w).mean(), torch.ones(16, 4))
    assert torch.allclose(w.grad, torch.ones(4))


# ------------------------------------------------------------------ what acting takes


def hb(pid: int, t: float, event: str = "step") -> Heartbeat:
    return Heartbeat(pid=pid, rank=0, time=t, event=event)


def test_step_and_save_durations_come_from_the_heartbeats():
    d = _Durations()
    for beat in [hb(1, 10.0), hb(1, 10.5), hb(2, 10.1), hb(2, 10.8),  # per process: .5, .7
                 hb(1, 11.0, "save_begin"), hb(1, 11.4, "save_end"),
                 hb(1, 13.0),  # after a save: not a step interval (the save is counted apart)
                 hb(1, 13.6)]:
        d.heartbeat(beat)
    assert d.steps == pytest.approx([0.5, 0.7, 0.6]) and d.saves == pytest.approx([0.4])
    for i in range(10):
        d.heartbeat(hb(3, 20.0 + i))
    assert len(d.steps) == 5  # the newest five


@pytest.mark.parametrize(("timings", "relieve", "stop"), [
    (Timings(), PRIOR_STEP_S, PRIOR_STEP_S + PRIOR_SAVE_S),
    (Timings(step_s=0.45), 0.45, 0.45 + PRIOR_SAVE_S),
    (Timings(relieve_s=0.2, step_s=0.45, save_s=0.3), 0.2, 0.75),
])
def test_timings_fall_back_on_the_priors(timings, relieve, stop):
    assert timings.relieve == pytest.approx(relieve) and timings.stop == pytest.approx(stop)
