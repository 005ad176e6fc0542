"""Budgets that refill with progress, and the failure-rate guard: decide() over long synthetic
histories (a simulated month), table by table. Pure: no processes, a fed-in clock."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from observed import observed

from rtrain.supervisor.config import Config, RestartConfig, load_config
from rtrain.supervisor.decide.failures import Failure, FailureKind
from rtrain.supervisor.decide.policy import Action, Decision, History, decide, note_progress
from rtrain.supervisor.records.runstate import RunState, load_state, save_state

K = FailureKind
DAY = 86400.0
SETTINGS = {"batch_size": 64, "grad_accum": 1, "lr": 0.1}


def fail(kind: FailureKind, **ev) -> Failure:
    return Failure(kind=kind, reason=f"it was {kind.value}", seen=observed(**ev))


@dataclass
class Sim:
    """A run as the launch loop drives it: each attempt resumes from the newest checkpoint,
    trains `steps` (committing one every `save_every`), then ends with `kind`."""

    config: Config
    save_every: int = 100
    step: int = 0  # newest committed checkpoint step
    t: float = 0.0
    history: History = field(default_factory=History)
    tmp: object = None  # a directory: state.json round trips (requeues)

    def attempt(self, kind: FailureKind, steps: int, *, hours: float = 0.0, seconds: float = 60.0,
                stop: bool = False) -> Decision:
        resumed = self.step
        if self.history.launch_step is None and resumed:  # as the launch loop sets it
            self.history = replace(self.history, launch_step=resumed)
        last = resumed + steps
        self.step = max(self.step, last // self.save_every * self.save_every)
        self.t += hours * 3600 + seconds
        # The watch measures every attempt: a small footprint, so a climb back always fits.
        h = note_progress(self.history, observed(last_step=last, peak_rss_bytes=1 << 30,
                                                 host_mem_limit=16 << 30),
                          resumed_step=resumed, duration_s=seconds)
        f = fail(kind, stop_requested="SIGUSR1" if stop else None)
        d = decide(f, h, self.config, rand=0.0, newest_step=self.step or None, now=self.t)
        self.history = d.history
        return d

    def requeue(self) -> None:
        """A preemption: the job ends, a new rtrain reads state.json back."""
        d = self.attempt(K.PREEMPTED, 30, stop=True)
        assert d.action is Action.EXIT_PREEMPTED
        save_state(self.tmp, RunState(command=["train.py"], history=d.history))
        self.history = load_state(self.tmp).history


def cfg(**restart) -> Config:
    return Config(settings=dict(SETTINGS), restore_after_steps=100,
                  restart=RestartConfig(**restart))


MIXED = [K.CRASH, K.OOM_GPU, K.HANG, K.CRASH, K.LOST_DEVICE, K.NONFINITE, K.DATA, K.OOM_HOST,
         K.CRASH, K.HANG]


@pytest.mark.parametrize("kinds", [[K.CRASH], MIXED], ids=["crashes", "mixed-kinds"])
@pytest.mark.parametrize("requeues", [False, True], ids=["one-job", "requeued"])
def test_fifty_failures_in_a_month_with_progress_never_give_up(tmp_path, kinds, requeues):
    sim = Sim(cfg(), tmp=tmp_path)
    for i in range(50):
        d = sim.attempt(kinds[i % len(kinds)], 250, hours=30 * 24 / 50)
        assert d.action is Action.RELAUNCH, (i, d.reason)
        assert d.history.total_restarts == 0  # each advanced the newest checkpoint: no charge
        if requeues and i % 5 == 4:
            sim.requeue()
    h = sim.history
    assert h.budgets_used == {}
    assert sim.t > 29 * DAY and sim.step >= 50 * 200


@pytest.mark.parametrize("steps, save_every, restart", [
    (25, 2, {}),  # kills seconds apart, each after forgive_after_steps steps: forgiven
    (3, 2, {"max_restarts": 1000}),  # a step or two past a save each time: no crash loop
], ids=["forgiven", "crash-loop-rule-only"])
def test_kills_seconds_apart_that_each_commit_a_newer_checkpoint_never_give_up(
        steps, save_every, restart):
    """A run SIGKILLed every few seconds from its start whose every attempt commits a newer
    checkpoint (the early first save under every="auto" makes that possible) is never ended
    by the crash-loop rule, however many kills."""
    sim = Sim(cfg(**restart), save_every=save_every)
    for i in range(60):
        d = sim.attempt(K.CRASH, steps, seconds=4.0)
        assert d.action is Action.RELAUNCH, (i, d.reason)
        assert d.history.stalled == ()
    assert sim.step >= 60 * (steps // save_every * save_every)


def test_three_failures_without_progress_give_up_by_the_crash_loop_rule():
    sim = Sim(cfg())
    sim.attempt(K.CRASH, 500)  # got somewhere first: checkpoint 500
    actions = [sim.attempt(K.CRASH, 50).action for _ in range(3)]  # dies before the next save
    assert actions == [Action.RELAUNCH, Action.RELAUNCH, Action.GIVE_UP]
    assert sim.history.forgiven == 0


def test_mixed_kinds_without_progress_give_up_fast():
    sim = Sim(cfg())
    sim.attempt(K.CRASH, 300)
    d = [sim.attempt(k, 10) for k in (K.HANG, K.LOST_DEVICE, K.CRASH)]
    assert [x.action for x in d] == [Action.RELAUNCH, Action.RELAUNCH, Action.GIVE_UP]
    assert "crash loop: 3 consecutive attempts ended without a newer verified" in d[-1].reason


def test_without_progress_and_no_crash_loop_rule_the_budget_stops_and_names_its_knob():
    sim = Sim(cfg(crash_loop_k=0))
    d = [sim.attempt(K.CRASH, 10) for _ in range(4)]
    assert [x.action for x in d] == [Action.RELAUNCH] * 3 + [Action.GIVE_UP]
    assert ("the crash budget is spent (3 of 3 relaunches after crash failures without "
            "progress in between): [restart.budgets] crash = 3 (the default)") in d[-1].reason


@pytest.mark.parametrize(("steps", "seconds", "forgiven"), [
    (250, 60, True),  # a newer checkpoint and 250 steps
    (150, 60, True),  # checkpoint 100 -> 200: newer, and above forgive_after_steps
    (10, 60, False),  # no newer checkpoint
    (10, 700, False),  # long, but no newer checkpoint
])
def test_what_counts_as_progress(steps, seconds, forgiven):
    sim = Sim(cfg(), step=100)
    sim.attempt(K.CRASH, 10)
    d = sim.attempt(K.CRASH, steps, seconds=seconds)
    assert (d.history.forgiven == 1) is forgiven
    # A failure after a newer checkpoint is not charged; one without is.
    assert d.history.budgets_used == ({} if forgiven else {"crash": 2})


def test_minutes_of_training_count_when_steps_are_few():
    config = cfg(forgive_after_steps=1000, forgive_after_s=600)
    sim = Sim(config, save_every=10, step=100)
    sim.attempt(K.CRASH, 5)  # no newer checkpoint: charged
    sim.attempt(K.CRASH, 5)
    d = sim.attempt(K.CRASH, 15, seconds=60)  # a newer checkpoint, 15 steps: not charged...
    assert d.history.forgiven == 0 and d.history.budgets_used == {"crash": 2}  # ...nor forgiving
    d = sim.attempt(K.CRASH, 15, seconds=700)  # ... and 700 s: the earlier two forgiven
    assert d.history.forgiven == 2 and d.history.budgets_used == {}


def test_attempts_that_each_advance_a_little_never_spend_a_budget():
    """Kills every few seconds, each attempt committing a checkpoint one step newer and
    training far fewer than forgive_after_steps: never charged, never ended (the crash budget
    is 3)."""
    sim = Sim(cfg(), save_every=1, step=10)
    for i in range(40):
        d = sim.attempt(K.CRASH, 1, seconds=3.0)
        assert d.action is Action.RELAUNCH and d.history.budgets_used == {}, (i, d.reason)
    assert sim.step == 50
    assert sim.attempt(K.CRASH, 0).history.budgets_used == {"crash": 1}  # no step: charged


def test_rate_guard_reports_then_stops_when_configured():
    sim = Sim(cfg())
    for _ in range(10):
        d = sim.attempt(K.CRASH, 250, seconds=300)  # progress every time, 12 an hour
        assert d.alarm is None and d.action is Action.RELAUNCH
    d = sim.attempt(K.CRASH, 250, seconds=300)
    assert d.action is Action.RELAUNCH
    assert d.alarm == "11 failures in the last hour, more than 10"
    stop = Sim(cfg(give_up_on_rate=True))
    actions = [stop.attempt(K.CRASH, 250, seconds=300).action for _ in range(11)]
    assert actions == [Action.RELAUNCH] * 10 + [Action.GIVE_UP]


def test_rate_guard_forgets_after_an_hour_and_can_be_off():
    sim = Sim(cfg(max_failures_per_hour=2))
    alarms = [sim.attempt(K.CRASH, 250, seconds=1900).alarm for _ in range(6)]  # 2 an hour
    assert alarms == [None, None, None, None, None, None]
    off = Sim(cfg(max_failures_per_hour=0))
    assert all(off.attempt(K.CRASH, 250, seconds=1).alarm is None for _ in range(30))


def test_preemptions_are_free_and_progress_carries_across_them(tmp_path):
    sim = Sim(cfg(crash_loop_k=0), tmp=tmp_path)
    sim.attempt(K.CRASH, 10)
    sim.requeue()  # trains 30 steps, no checkpoint
    sim.requeue()
    d = sim.attempt(K.CRASH, 150)  # with the 60 steps before: a newer checkpoint, 210 steps
    assert d.history.forgiven == 1 and d.history.total_restarts == 0


# ------------------------------------------------------------ --max-restarts means what it says


def test_cli_max_restarts_is_never_capped_by_default_budgets(tmp_path):
    config = load_config({"max_restarts": 10}, None, tmp_path)
    config.restart.crash_loop_k = 0
    sim = Sim(config)
    d = [sim.attempt(K.CRASH, 10) for _ in range(11)]
    assert [x.action for x in d] == [Action.RELAUNCH] * 10 + [Action.GIVE_UP]
    assert ("10 relaunches after failures without progress in between, the limit: "
            "max_restarts = 10 (set; --max-restarts N or [restart] max_restarts)") in d[-1].reason


def test_a_budget_the_user_set_still_applies_and_is_named(tmp_path):
    (tmp_path / "rtrain.toml").write_text("[restart.budgets]\ncrash = 2\n")
    sim = Sim(load_config({"max_restarts": 10, "restart.crash_loop_k": 0}, None, tmp_path))
    d = [sim.attempt(K.CRASH, 10) for _ in range(3)]
    assert d[-1].action is Action.GIVE_UP
    assert "[restart.budgets] crash = 2; raise it" in d[-1].reason
    # any other kind still gets the 10 asked for
    assert sim.attempt(K.HANG, 10).action is Action.RELAUNCH


def test_default_budget_message_when_max_restarts_set_names_max_restarts(tmp_path):
    (tmp_path / "rtrain.toml").write_text("[restart]\nmax_restarts = 2\n")
    sim = Sim(load_config({"restart.crash_loop_k": 0}, None, tmp_path))
    d = [sim.attempt(K.DATA, 10) for _ in range(3)]
    assert [x.action for x in d] == [Action.RELAUNCH] * 2 + [Action.GIVE_UP]
    assert "max_restarts = 2 (set;" in d[-1].reason


# ------------------------------------------------------------ quarantine: what counts as poison

CKPT = "/ckpts/checkpoint-40"


@pytest.mark.parametrize(("attempts", "quarantined"), [
    ([(K.CRASH, 41), (K.CRASH, 41)], True),  # same kind, same step: its state or data position
    ([(K.NONFINITE, 43), (K.NONFINITE, 43)], True),
    ([(K.CRASH, 41), (K.CRASH, 44)], False),  # random moments: outside kills
    ([(K.CRASH, None), (K.CRASH, None)], False),  # died in start-up: the checkpoint unused
    ([(K.CRASH, 41), (K.HANG, 41)], False),  # different kinds
    ([(K.OOM_GPU, 41), (K.OOM_GPU, 41)], False),  # the ladder's business
    ([(K.CRASH, 41), (K.CRASH, None), (K.CRASH, 41)], False),  # not in a row
    ([(K.CRASH, 44), (K.CRASH, 41), (K.CRASH, 41)], True),
])
def test_which_streaks_quarantine_a_checkpoint(attempts, quarantined):
    from rtrain.supervisor.decide.policy import Resumed

    config = cfg(crash_loop_k=0)
    h = History(launch_step=40)
    resumed = Resumed(path=CKPT, id="7-1", step=40)
    decisions = []
    for kind, last in attempts:
        f = fail(kind, last_step=last, returncode=1)
        d = decide(f, h, config, rand=0.0, newest_step=40, resumed=resumed, now=0.0)
        decisions.append(d)
        h = d.history
    assert (decisions[-1].quarantine is not None) is quarantined
    assert all(d.quarantine is None for d in decisions[:-1])
    if quarantined:
        assert h.quarantined[0]["path"] == CKPT and h.quarantined[0]["id"] == "7-1"
        assert "2 attempts in a row resumed from it and failed" in h.quarantined[0]["reason"]


@pytest.mark.parametrize(("signal", "hang", "quarantined"), [
    ("SIGKILL", False, False),  # killed from outside, at a save both times: says nothing
    ("SIGTERM", False, False),
    ("SIGKILL", True, True),  # rtrain's own kill of a hang at the same step: a data position
    ("SIGSEGV", False, True),  # crashed by itself
    (None, False, True),
])
def test_outside_kills_never_quarantine(signal, hang, quarantined):
    from rtrain.supervisor.decide.policy import Resumed

    config, h = cfg(crash_loop_k=0), History(launch_step=40)
    resumed = Resumed(path=CKPT, id="7-1", step=40)
    for _ in range(2):
        f = fail(K.HANG if hang else K.CRASH, last_step=44, signal=signal,
                 returncode=None if signal else 1, hang=hang)
        d = decide(f, h, config, rand=0.0, newest_step=40, resumed=resumed)
        h = d.history
    assert (d.quarantine is not None) is quarantined
