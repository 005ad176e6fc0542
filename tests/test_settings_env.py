"""RTRAIN_SETTINGS, read in one place: `settings()` refuses a bad value, readers in passing
(guards, faults) see none."""

from __future__ import annotations

import pytest

from rtrain.supervisor.core.protocol import ENV_SETTINGS
from rtrain.worker.settings import current, settings


def test_the_supervisors_values_overlay_the_defaults_keeping_types(monkeypatch):
    monkeypatch.setenv(ENV_SETTINGS, '{"batch_size": 16.0, "lr": 1}')
    s = settings(batch_size=64, lr=0.1, name="x")
    assert s == {"batch_size": 16, "lr": 1.0, "name": "x"}
    assert isinstance(s.batch_size, int) and isinstance(s.lr, float)
    assert current() == {"batch_size": 16.0, "lr": 1}


@pytest.mark.parametrize(("raw", "message"), [("{oops", "is not valid JSON"),
                                              ("[1, 2]", "must be a JSON object")])
def test_a_bad_value_stops_settings_but_reads_as_none_in_passing(monkeypatch, raw, message):
    monkeypatch.setenv(ENV_SETTINGS, raw)
    with pytest.raises(ValueError, match=message):
        settings(batch_size=64)
    assert current() == {}


def test_unset_means_the_defaults(monkeypatch):
    monkeypatch.delenv(ENV_SETTINGS, raising=False)
    assert settings(batch_size=64) == {"batch_size": 64}
    assert current() == {}
