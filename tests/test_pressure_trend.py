"""The trend rule of the pressure decision (pressure/decide.py), by table on recorded memory
curves (tests/pressure_curves.json): steady growths at several rates are acted on while the stop
still fits before the limit; a run flat at 92%, a per-step transient spike, noise, a start-up
ramp and a one-off spike are left alone. With the defaults of `[pressure]` and of the watch's
sample interval (1 s), and with the faster sampling the curves recorded at 0.1 s have."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rtrain.supervisor.config import Config, PressureConfig
from rtrain.supervisor.pressure.decide import (
    MIN_PEAKS,
    PRIOR_SAVE_S,
    PRIOR_STEP_S,
    Act,
    MemoryReading,
    PressureState,
    Rule,
    Timings,
    Verdict,
    advance,
    answered,
    forecast,
)
from rtrain.supervisor.pressure.monitor import rule_of

MIB = 1 << 20
CURVES = json.loads((Path(__file__).parent / "pressure_curves.json").read_text())["curves"]
DEFAULTS = PressureConfig()


PRIORS = Timings()


def replay(name: str, timings: Timings = PRIORS, answer_after_s: float | None = None,
           config: PressureConfig = DEFAULTS) -> list[tuple[float, Verdict]]:
    """Feed a recorded curve to `advance` with the default rule; the verdicts that acted.
    `answer_after_s`: the worker answers a relieve request this long after it."""
    curve = CURVES[name]
    dt, limit = curve["interval_s"], curve["limit_mib"] * MIB
    rule = rule_of(config, dt)
    state, acts, asked = PressureState(), [], None
    for i, mib in enumerate(curve["mib"]):
        now = i * dt
        if asked is not None and answer_after_s is not None and now >= asked + answer_after_s:
            state, asked = answered(state, now), None
        reading = MemoryReading("cgroup", int(mib * MIB), limit, config.fraction)
        state, verdict = advance(state, [reading], now, rule, timings)
        if verdict.act is not Act.NONE:
            acts.append((now, verdict))
            if verdict.act is Act.RELIEVE:
                asked = now
            else:
                break
    return acts


def _rate(name: str) -> float:
    mib = CURVES[name]["mib"]
    return (mib[-1] - mib[0]) / ((len(mib) - 1) * CURVES[name]["interval_s"])


def test_the_defaults_are_the_documented_ones():
    assert (DEFAULTS.fraction, DEFAULTS.sustain_s, DEFAULTS.trend_s, DEFAULTS.peak_window_s,
            DEFAULTS.trend_from, DEFAULTS.margin) == (0.95, 5.0, 8.0, 1.0, 0.5, 2.0)
    assert Config().sample_interval_s == 1.0
    assert (PRIOR_STEP_S, PRIOR_SAVE_S) == (1.0, 2.0)


GROWTHS = ["grow_18_mib_s", "grow_last_quarter_in_3_s", "grow_last_quarter_in_5_s",
           "grow_8_mib_s", "grow_18_mib_s_stairs_fast_samples"]
CALM = ["flat_92", "flat_92_fast_samples", "step_spike", "step_spike_fast_samples", "noise_85",
        "startup_then_flat", "one_off_spike"]


def test_every_curve_is_in_the_table():
    assert sorted(CURVES) == sorted([*GROWTHS, *CALM, "creep_to_hard_line"])
    assert {CURVES[n]["expect"] for n in GROWTHS} == {"act"}
    assert {CURVES[n]["expect"] for n in CALM} == {"none"}


@pytest.mark.parametrize("timings", [Timings(), Timings(step_s=0.45, save_s=0.3)],
                         ids=["priors", "measured"])
@pytest.mark.parametrize("answer_after_s", [None, 0.5])
@pytest.mark.parametrize("name", GROWTHS)
def test_a_steady_growth_is_stopped_while_the_stop_still_fits(name, timings, answer_after_s):
    acts = replay(name, timings, answer_after_s)
    assert acts and acts[-1][1].act is Act.DEGRADE, acts
    at, verdict = acts[-1]
    mib = CURVES[name]["mib"][round(at / CURVES[name]["interval_s"])]
    left_s = (CURVES[name]["limit_mib"] - mib) / _rate(name)
    assert left_s >= timings.stop, (at, mib, verdict.why)  # saved before the limit
    assert verdict.left_s is not None and "MiB/s" in verdict.why
    # the rate it saw is the curve's
    assert verdict.left_s == pytest.approx(left_s, rel=0.35, abs=0.6)


def test_relief_comes_first_when_there_is_time_for_it():
    acts = replay("grow_8_mib_s", Timings(step_s=0.45, save_s=0.3), answer_after_s=0.5)
    assert [v.act for _, v in acts] == [Act.RELIEVE, Act.DEGRADE]
    assert "relief and the stop take about" in acts[0][1].why
    assert "relief did not make room" in acts[1][1].why


def test_no_time_for_relief_goes_straight_to_the_stop():
    acts = replay("grow_last_quarter_in_3_s")  # the priors: relief + stop take 4 s
    assert [v.act for _, v in acts] == [Act.DEGRADE]
    assert "no time to try relief" in acts[0][1].why


@pytest.mark.parametrize("timings", [Timings(), Timings(step_s=0.45, save_s=0.3)],
                         ids=["priors", "measured"])
@pytest.mark.parametrize("name", CALM)
def test_a_run_that_does_not_grow_is_left_alone(name, timings):
    assert replay(name, timings) == []


def test_a_slow_creep_is_the_hard_lines():
    acts = replay("creep_to_hard_line", answer_after_s=1.0)
    assert [v.act for _, v in acts] == [Act.RELIEVE, Act.DEGRADE]
    assert all(v.left_s is None and "threshold 95%" in v.why for _, v in acts)
    first = acts[0][0]
    mib = CURVES["creep_to_hard_line"]["mib"]
    crossed = next(i for i, m in enumerate(mib) if m >= 0.95 * 700)
    assert first >= crossed + DEFAULTS.sustain_s


def test_no_trend_rule_leaves_the_hard_line_alone():
    off = PressureConfig(trend_s=0)
    assert replay("grow_18_mib_s", config=off) == []  # grows past the limit: the kernel's
    assert [v.act for _, v in replay("creep_to_hard_line", config=off)] == [Act.RELIEVE,
                                                                             Act.DEGRADE]


# ------------------------------------------------------------------ forecast


def _peaks(values, dt=1.0):
    return tuple((i * dt, int(v * MIB)) for i, v in enumerate(values))


R = MemoryReading("cgroup", 0, 1000 * MIB, 0.95)


@pytest.mark.parametrize(("values", "rate"), [
    ([600, 610, 620, 630, 640], 10),  # steady
    ([600, 610, 700, 630, 640, 650], 10),  # one spike: the median keeps the line
    ([600, 610, 620, 630], None),  # too few windows
    ([300, 310, 320, 330, 340], None),  # below trend_from
    ([400, 600, 700, 700, 701, 700], None),  # a ramp that levelled off
    ([600, 640, 600, 640, 600, 640, 600], None),  # noise / spikes at the sampling's phase
])
def test_forecast(values, rate):
    f = forecast(_peaks(values), R, Rule())
    if rate is None:
        assert f is None
    else:
        assert f is not None and f.rate == pytest.approx(rate * MIB)
        assert f.left_s == pytest.approx((1000 - max(values[-3:])) / rate)


def test_the_slowest_memory_to_run_out_is_not_the_one_acted_on():
    rule = Rule(interval_s=1.0)
    state, verdict = PressureState(), Verdict()
    for t in range(12):
        host = MemoryReading("cgroup", (500 + 5 * t) * MIB, 1000 * MIB, 0.95)
        gpu = MemoryReading("gpu0", (60 + 3 * t) * MIB, 100 * MIB, 0.98)
        state, verdict = advance(state, [host, gpu], float(t), rule)
        if verdict.act is not Act.NONE:
            break
    assert verdict.reading is not None and verdict.reading.source == "gpu0"


def test_the_trend_constants_hold_together():
    # The trend needs MIN_PEAKS peaks in its window; a share of the limit is below 1; acting
    # is counted at least once over.
    assert DEFAULTS.trend_s >= (MIN_PEAKS - 1) * DEFAULTS.peak_window_s > 0
    assert 0 < DEFAULTS.trend_from < DEFAULTS.fraction <= 1 and DEFAULTS.margin >= 1


def _first_rising(name: str) -> float | None:
    curve = CURVES[name]
    dt, limit = curve["interval_s"], curve["limit_mib"] * MIB
    state, rule = PressureState(), rule_of(DEFAULTS, dt)
    for i, mib in enumerate(curve["mib"]):
        reading = MemoryReading("cgroup", int(mib * MIB), limit, DEFAULTS.fraction)
        state, verdict = advance(state, [reading], i * dt, rule, Timings(0.5, 0.45, 0.3))
        if verdict.rising:
            assert verdict.act is Act.NONE and verdict.why
            return i * dt
        if verdict.act is not Act.NONE:
            return None
    return None


@pytest.mark.parametrize("name", ["grow_18_mib_s", "grow_8_mib_s", "creep_to_hard_line"])
def test_rising_pressure_is_said_before_anything_is_asked(name):
    rising = _first_rising(name)
    first_act = replay(name, Timings(0.5, 0.45, 0.3))[0][0]
    assert rising is not None and rising < first_act


@pytest.mark.parametrize("name", CALM)
def test_a_calm_run_is_never_rising(name):
    if name == "one_off_spike":  # a sample above the hard line: worth what costs nothing
        assert _first_rising(name) == 30.0
    else:
        assert _first_rising(name) is None
