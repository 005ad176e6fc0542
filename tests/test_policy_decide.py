"""decide(): each rule, by table, with scripted failures and histories."""

from __future__ import annotations

from dataclasses import replace

import pytest
from observed import observed

from rtrain.supervisor.config import BackoffConfig, Config, RestartConfig
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.observation import Heartbeats
from rtrain.supervisor.decide.policy import (
    Action,
    History,
    ResumeMode,
    backoff_s,
    decide,
    note_progress,
)

K = FailureKind
SETTINGS = {"batch_size": 64, "grad_accum": 1, "lr": 0.1}


def cfg(**kw) -> Config:
    kw.setdefault("settings", dict(SETTINGS))
    return Config(**kw)


def fail(kind: FailureKind, **ev) -> Failure:
    return Failure(kind=kind, reason=f"it was {kind.value}", seen=observed(**ev))


def test_exit_zero_finishes():
    d = decide(None, History(), cfg(), rand=0.5)
    assert (d.action, d.exit_code) == (Action.FINISHED, 0)


@pytest.mark.parametrize(("requeue", "action"), [(False, Action.EXIT_PREEMPTED),
                                                  (True, Action.REQUEUE)])
def test_stop_from_a_signal_to_the_supervisor(requeue, action):
    h = History(attempt=4, budgets_used={"crash": 3}, total_restarts=20)  # all budgets spent
    d = decide(fail(K.PREEMPTED, returncode=75, stop_requested="SIGUSR1"), h, cfg(requeue=requeue),
               rand=0.0, newest_step=100)
    assert (d.action, d.exit_code) == (action, 75)
    assert d.history.attempt == 5  # the requeued job continues the numbering
    assert d.history.budgets_used == {"crash": 3} and d.history.total_restarts == 20


def test_stop_requested_wins_over_any_kind():
    d = decide(fail(K.OOM_GPU, returncode=1, stop_requested="SIGTERM"), History(), cfg(), rand=0)
    assert d.action is Action.EXIT_PREEMPTED and d.settings == SETTINGS


def test_exit_75_on_its_own_relaunches_without_budget_or_degrading():
    d = decide(fail(K.PREEMPTED, returncode=75), History(), cfg(), rand=0.3, newest_step=10)
    assert d.action is Action.RELAUNCH
    assert d.settings == SETTINGS and d.level == 0 and d.backoff_s == 0
    assert d.history.total_restarts == 0 and d.history.budgets_used == {}
    assert d.history.attempt == 1


def test_startup_is_not_retried():
    d = decide(fail(K.STARTUP, returncode=1), History(), cfg(), rand=0)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 3)
    assert "not retrying" in d.reason


@pytest.mark.parametrize(("kind", "budget"), [(K.CRASH, "crash"), (K.HANG, "hang"),
                                              (K.LOST_DEVICE, "lost_device"), (K.DATA, "data"),
                                              (K.NONFINITE, "nonfinite"), (K.OOM_GPU, "oom"),
                                              (K.OOM_HOST, "oom")])
def test_separate_budgets_per_kind(kind, budget):
    config = cfg(restart=RestartConfig(budgets={budget: 2}, crash_loop_k=0))
    h = History()
    for _ in range(2):
        d = decide(fail(kind, returncode=1), h, config, rand=0)
        assert d.action is Action.RELAUNCH, d.reason
        h = d.history
    assert h.budgets_used == {budget: 2}
    d = decide(fail(kind, returncode=1), h, config, rand=0)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 1)
    assert f"the {budget} budget is spent (2 of 2" in d.reason
    # spending one kind leaves the others untouched
    other = K.HANG if kind is not K.HANG else K.CRASH
    assert decide(fail(other, returncode=1), h, config, rand=0).action is Action.RELAUNCH


def test_total_restart_cap():
    config = cfg(restart=RestartConfig(max_restarts=2, crash_loop_k=0))
    d = decide(fail(K.CRASH), History(total_restarts=2), config, rand=0)
    assert d.action is Action.GIVE_UP and "max_restarts" in d.reason


@pytest.mark.parametrize(("stalled", "rand", "expected"), [
    (0, 0.0, 1.0), (1, 0.0, 2.0), (3, 0.0, 8.0), (20, 0.0, 300.0),  # capped
    (3, 0.5, 8.0 * (1 - 0.25 * 0.5)),  # jitter takes up to 25% off
])
def test_backoff_grows_while_no_progress_and_is_capped(stalled, rand, expected):
    config = cfg(restart=RestartConfig(crash_loop_k=0, budgets={"crash": 100}))
    h = History(launch_step=50, stalled=(50,) * stalled)
    d = decide(fail(K.CRASH), h, config, rand=rand, newest_step=50)
    assert d.backoff_s == pytest.approx(expected)


def test_a_failure_after_progress_relaunches_at_once_and_backoff_can_be_off():
    h = History(launch_step=50, stalled=(50, 50))
    d = decide(fail(K.CRASH), h, cfg(), rand=0, newest_step=60)
    assert d.backoff_s == 0.0 and d.history.stalled == () and d.history.launch_step == 60
    # The first failure without progress after it waits the initial second, then it grows.
    d = decide(fail(K.CRASH), d.history, cfg(), rand=0, newest_step=60)
    assert d.backoff_s == 1.0
    d = decide(fail(K.CRASH), d.history, cfg(), rand=0, newest_step=60)
    assert d.backoff_s == 2.0
    off = cfg(backoff=BackoffConfig(enabled=False))
    assert decide(fail(K.CRASH), h, off, rand=0.9, newest_step=60).backoff_s == 0
    assert backoff_s(cfg(), 10_000, 0.0) == 300.0  # no overflow


def test_crash_loop_stops_when_checkpoint_does_not_advance():
    config = cfg(restart=RestartConfig(crash_loop_k=3, budgets={"crash": 100, "hang": 100}))
    h = History(launch_step=40)
    actions = []
    for kind in (K.CRASH, K.HANG, K.CRASH):
        d = decide(fail(kind), h, config, rand=0, newest_step=40)
        actions.append(d.action)
        h = d.history
    assert actions == [Action.RELAUNCH, Action.RELAUNCH, Action.GIVE_UP]
    assert "crash loop: 3 consecutive attempts" in d.reason and "step 40" in d.reason


def test_crash_loop_without_any_checkpoint():
    config = cfg(restart=RestartConfig(crash_loop_k=1))
    d = decide(fail(K.CRASH), History(), config, rand=0, newest_step=None)
    assert d.action is Action.GIVE_UP and "no checkpoint yet" in d.reason


@pytest.mark.parametrize("ev, loops", [
    ({"signal": "SIGKILL", "duration_s": 61.0}, False),   # trained a minute: outside kill
    ({"signal": "SIGTERM", "duration_s": 600.0}, False),
    ({"signal": "SIGKILL", "duration_s": 5.0}, True),     # killed in its start-up
    ({"signal": "SIGSEGV", "duration_s": 600.0}, True),   # its own crash
    ({"signal": "SIGKILL", "duration_s": 600.0, "hang": True}, True),  # our stop at a hang
    ({"signal": "SIGKILL", "duration_s": 600.0, "last_step": 9,        # steps past the resume
      "heartbeats": Heartbeats(count=3)}, False),
    ({"signal": "SIGKILL", "duration_s": 600.0, "last_step": None,     # heartbeats, no step
      "heartbeats": Heartbeats(count=3)}, True),
])
def test_outside_kills_while_training_leave_it_to_the_budgets(ev, loops):
    """A script that cannot resume, killed from outside three times: a crash loop only when the
    attempts did not train or failed by themselves; otherwise the budgets charge each kill."""
    h, config = History(), cfg()
    actions = []
    for _ in range(4):
        d = decide(fail(K.CRASH, **ev), h, config, rand=0, newest_step=None)
        actions.append(d.action)
        h = d.history
        if d.action is Action.GIVE_UP:
            break
    if loops:
        assert actions == [Action.RELAUNCH, Action.RELAUNCH, Action.GIVE_UP]
        assert "crash loop" in d.reason
    else:
        assert actions == [Action.RELAUNCH] * 3 + [Action.GIVE_UP]
        assert "the crash budget is spent (3 of 3" in d.reason
        assert h.budgets_used == {"crash": 3} and h.stalled == ()


def test_oom_steps_down_the_ladder_keeping_effective_batch():
    d = decide(fail(K.OOM_GPU), History(), cfg(), rand=0, newest_step=None)
    assert d.action is Action.RELAUNCH
    assert d.settings == {"batch_size": 32, "grad_accum": 2, "lr": 0.1}
    assert d.level == 1 and d.history.level == 1 and d.history.settings == d.settings
    assert "batch_size 64 -> 32" in d.ladder_change
    assert d.history.budgets_used == {"oom": 1}


def test_an_oom_after_progress_steps_down_at_once_one_without_waits_the_first_backoff():
    d = decide(fail(K.OOM_GPU), History(launch_step=10), cfg(), rand=0, newest_step=20)
    assert d.action is Action.RELAUNCH and d.level == 1 and d.backoff_s == 0.0
    d = decide(fail(K.OOM_GPU), History(launch_step=20), cfg(), rand=0, newest_step=20)
    assert d.action is Action.RELAUNCH and d.level == 1 and d.backoff_s == 1.0


def test_ooms_do_not_count_as_a_crash_loop():
    config = cfg(restart=RestartConfig(crash_loop_k=2))
    h = History()
    for _ in range(5):
        d = decide(fail(K.OOM_HOST), h, config, rand=0, newest_step=None)
        assert d.action is Action.RELAUNCH, d.reason
        h = d.history
    assert d.settings["batch_size"] == 2


def test_oom_at_floor_gives_up_saying_what_was_tried():
    config = cfg(settings={"batch_size": 2, "grad_accum": 1})
    h = History()
    d = decide(fail(K.OOM_GPU), h, config, rand=0)
    assert d.action is Action.RELAUNCH
    d = decide(fail(K.OOM_GPU), d.history, config, rand=0)
    assert (d.action, d.exit_code) == (Action.GIVE_UP, 1)
    assert "ladder's floor" in d.reason and "Tried: batch_size 2 -> 1" in d.reason
    assert "batch_size at 1 (floor 1)" in d.reason


def test_oom_adopts_settings_the_worker_backed_off_to():
    f = fail(K.OOM_GPU, exit_records=[{"kind": "oom_gpu", "settings": {"batch_size": 16,
                                                                       "unknown": 1}}])
    d = decide(f, History(), cfg(), rand=0)
    assert d.settings["batch_size"] == 8 and "unknown" not in d.settings


def test_nonfinite_rolls_back_and_cuts_lr():
    d = decide(fail(K.NONFINITE), History(), cfg(), rand=0, newest_step=100)
    assert d.action is Action.RELAUNCH and d.resume is ResumeMode.ROLLBACK
    assert d.settings["lr"] == pytest.approx(0.05) and d.history.lr_factor == 0.5
    assert d.settings["batch_size"] == 64


def test_nonfinite_without_lr_knob_records_lr_scale():
    config = cfg(settings={"batch_size": 8}, lr_factor_on_nonfinite=0.1)
    d = decide(fail(K.NONFINITE), History(), config, rand=0)
    assert d.settings == {"batch_size": 8, "lr_scale": pytest.approx(0.1)}
    d = decide(fail(K.NONFINITE), d.history, config, rand=0)
    assert d.settings["lr_scale"] == pytest.approx(0.01)


@pytest.mark.parametrize("kind", [K.CRASH, K.HANG, K.LOST_DEVICE])
def test_plain_failures_keep_the_rung(kind):
    d0 = decide(fail(K.OOM_GPU), History(), cfg(), rand=0)
    d = decide(fail(kind), d0.history, cfg(), rand=0)
    assert d.action is Action.RELAUNCH and d.resume is ResumeMode.LATEST
    assert d.settings == d0.settings and d.level == 1 and d.ladder_change is None


GIB = 1 << 30


def test_step_up_after_healthy_steps_when_the_rung_above_fits():
    config = cfg(restore_after_steps=100)
    # Rung 0 peaked at 6 of 10 GiB (a GPU OOM there, not the host): it fits under 0.9 - 0.1.
    h = note_progress(History(), observed(last_step=100, peak_rss_bytes=6 * GIB,
                                          host_mem_limit=10 * GIB), resumed_step=0)
    assert h.rung_peaks == {"0": {"host": 6 * GIB, "host_limit": 10 * GIB}}
    d0 = decide(fail(K.OOM_GPU), h, config, rand=0)
    h = note_progress(d0.history, observed(last_step=150), resumed_step=100)
    d = decide(fail(K.CRASH), h, config, rand=0)
    assert d.level == 1  # only 50 healthy steps
    h = note_progress(d.history, observed(last_step=260), resumed_step=150)
    d = decide(fail(K.CRASH, host_mem_limit=10 * GIB), h, config, rand=0)
    assert d.level == 0 and d.settings == SETTINGS and d.history.healthy_steps == 0
    assert "climbing back one rung" in d.reason and d.history.undo == ()
    assert "6144 MiB of 10240 MiB fit with 10% headroom" in d.reason


@pytest.mark.parametrize(("peak", "limit_now", "climbs"), [
    (None, 10 * GIB, False),  # never measured: nothing says it fits
    ({"host": 9 * GIB, "host_limit": 10 * GIB}, 10 * GIB, False),  # it hit the pressure line
    ({"host": 8 * GIB, "host_limit": 10 * GIB}, 10 * GIB, True),  # at 0.9 - 0.1 exactly
    ({"host": 9 * GIB, "host_limit": 10 * GIB}, 16 * GIB, True),  # requeued onto a bigger node
    ({"host": 5 * GIB, "host_limit": 10 * GIB}, None, True),  # limit unknown now: the record's
    ({"host": GIB, "gpu": 79 * GIB, "gpu_limit": 80 * GIB}, 10 * GIB, False),  # the GPU's full
])
def test_climb_back_only_when_the_recorded_peak_fits(peak, limit_now, climbs):
    h = History(level=1, settings={"batch_size": 32, "grad_accum": 2, "lr": 0.1},
                undo=({"set": {"batch_size": 64, "grad_accum": 1}, "description": "x"},),
                healthy_steps=600, rung_peaks={"0": peak} if peak else {})
    d = decide(fail(K.CRASH, host_mem_limit=limit_now), h, cfg(), rand=0)  # default: 500
    assert d.level == (0 if climbs else 1)
    assert d.history.healthy_steps == 0  # either way: asked again after 500 more
    if not climbs:
        assert "the rung above does not fit" in d.reason and d.history.undo == h.undo


def test_memory_pressure_goes_one_rung_down_on_the_oom_budget():
    d = decide(fail(K.MEMORY_PRESSURE, returncode=75, last_step=40), History(launch_step=40),
               cfg(), rand=0, newest_step=40)
    assert d.action is Action.RELAUNCH and d.level == 1
    assert d.settings["batch_size"] == 32 and d.settings["grad_accum"] == 2
    assert d.history.budgets_used == {"oom": 1} and d.ladder_change


def test_no_step_up_when_off_or_on_oom():
    h = History(level=1, settings={"batch_size": 32, "grad_accum": 2, "lr": 0.1},
                undo=({"set": {"batch_size": 64, "grad_accum": 1}, "description": "x"},),
                healthy_steps=10_000, rung_peaks={"0": {"host": 1, "host_limit": 10 * GIB}})
    assert decide(fail(K.CRASH), h, cfg(restore_after_steps=0), rand=0).level == 1
    assert decide(fail(K.OOM_GPU), h, cfg(restore_after_steps=10), rand=0).level == 2


def test_decide_does_not_mutate_history():
    h = History(budgets_used={"crash": 1})
    before = h.to_dict()
    decide(fail(K.CRASH), h, cfg(), rand=0, newest_step=5)
    decide(fail(K.OOM_GPU), h, cfg(), rand=0, newest_step=5)
    assert h.to_dict() == before


def test_history_round_trips_through_dict():
    h = History(attempt=3, budgets_used={"oom": 2}, level=2, settings={"batch_size": 16},
                undo=({"set": {"batch_size": 32}, "description": "d"},), stalled=(None, 4),
                launch_step=4, healthy_steps=7, lr_factor=0.25)
    assert History.from_dict(h.to_dict()) == h
    assert replace(h, attempt=4) != h
