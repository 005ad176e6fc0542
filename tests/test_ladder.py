"""The degradation ladder: pure steps down and back up."""

from __future__ import annotations

import pytest

from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.decide.ladder import (
    DEFAULT_LADDER,
    Floor,
    Rung,
    Step,
    parse_ladder,
    step_down,
    step_up,
)


def walk(settings, ladder=DEFAULT_LADDER, n=1):
    level, undo = 0, []
    for _ in range(n):
        step = step_down(settings, ladder, level)
        assert isinstance(step, Step), step
        settings, level = step.settings, step.level
        undo.append(step.undo)
    return settings, level, undo


def test_halve_with_grad_accum_keeps_effective_batch():
    settings = {"batch_size": 64, "grad_accum": 1}
    for n in range(1, 7):
        out, level, _ = walk(settings, n=n)
        assert out["batch_size"] == 64 >> n
        assert out["batch_size"] * out["grad_accum"] == 64
        assert level == n


def test_clamped_halving_never_shrinks_effective_batch():
    ladder = (Rung(knob="batch_size", floor=2, compensate="grad_accum"),)
    step = step_down({"batch_size": 3, "grad_accum": 1}, ladder, 0)
    assert step.settings == {"batch_size": 2, "grad_accum": 2}


def test_lr_compensation_scales_linearly_and_step_up_undoes_by_ratio():
    ladder = (Rung(knob="batch_size", floor=1, compensate="lr"),)
    step = step_down({"batch_size": 32, "lr": 0.1}, ladder, 0)
    assert step.settings == {"batch_size": 16, "lr": pytest.approx(0.05)}
    cut = {**step.settings, "lr": step.settings["lr"] * 0.5}  # a later non-finite lr cut
    assert step_up(cut, step.undo) == {"batch_size": 32, "lr": pytest.approx(0.05)}


def test_rungs_run_in_order_through_floors_then_floor_message():
    settings = {"batch_size": 2, "grad_accum": 1, "resolution": 100, "offload": False}
    ladder = (Rung(knob="batch_size", floor=1, compensate="grad_accum"),
              Rung(knob="resolution", action="scale", factor=0.75, floor=64),
              Rung(knob="offload", action="enable"))
    seen = []
    level = 0
    while isinstance(step := step_down(settings, ladder, level), Step):
        seen.append(step.description.split(" ")[0])
        settings, level = step.settings, step.level
    assert seen == ["batch_size", "resolution", "resolution", "offload"]
    assert settings == {"batch_size": 1, "grad_accum": 2, "resolution": 64, "offload": True}
    assert isinstance(step, Floor)
    assert "batch_size at 1 (floor 1)" in step.message
    assert "resolution at 64 (floor 64)" in step.message
    assert "offload already on" in step.message


def test_unknown_knob_rungs_are_skipped():
    step = step_down({"resolution": 224}, DEFAULT_LADDER, 0)
    assert step.settings == {"resolution": 168}
    assert isinstance(step_down({"lr": 0.1}, DEFAULT_LADDER, 0), Floor)
    assert "declare them under [settings]" in step_down({}, DEFAULT_LADDER, 0).message


def test_compensation_knob_absent_is_said():
    step = step_down({"batch_size": 8}, DEFAULT_LADDER, 0)
    assert step.settings == {"batch_size": 4}
    assert "nothing compensates" in step.description


def test_step_up_restores_recorded_values_newest_first():
    start = {"batch_size": 64, "grad_accum": 1, "resolution": 224}
    ladder = (Rung(knob="resolution", action="scale", factor=0.5, floor=100),
              Rung(knob="batch_size", compensate="grad_accum"))
    out, _, undo = walk(start, ladder, n=3)
    assert out == {"batch_size": 32, "grad_accum": 2, "resolution": 100}  # 224 -> 112 -> floor
    out = step_up(out, undo.pop())
    assert out == {"batch_size": 64, "grad_accum": 1, "resolution": 100}
    out = step_up(out, undo.pop())
    assert out == {"batch_size": 64, "grad_accum": 1, "resolution": 112}


def test_step_down_does_not_mutate_its_input():
    settings = {"batch_size": 64, "grad_accum": 1}
    step_down(settings, DEFAULT_LADDER, 0)
    assert settings == {"batch_size": 64, "grad_accum": 1}


@pytest.mark.parametrize(("raw", "message"), [
    ([{"knob": "batch_size", "action": "halfe"}], "did you mean 'halve'"),
    ([{"knob": "resolution", "action": "scale", "factor": 1.5}], "between 0 and 1"),
    ([{"knob": "batch_size", "compensate": "momentum"}], "compensate must be one of"),
    ([{"knob": "batch_size", "flor": 2}],
     "unknown key 'flor' in [[ladder]] #1 (did you mean 'floor'"),
    ([{"action": "halve"}], "needs a knob"),
    ({"knob": "batch_size"}, "list of [[ladder]] tables"),
])
def test_bad_rungs_say_what_to_change(raw, message):
    with pytest.raises(ConfigError) as err:
        parse_ladder(raw)
    assert message in str(err.value)
