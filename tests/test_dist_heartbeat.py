"""Hang detection across ranks: one silent rank is a hang even while the others report."""

from rtrain.supervisor.core.protocol import Heartbeat
from rtrain.supervisor.proc.heartbeat import HangClock, HangPolicy

P = HangPolicy(startup_s=100.0, warmup_steps=0, multiple=10.0, floor_s=5.0, ceiling_s=50.0,
               save_allowance_s=900.0, plain_timeout_s=1800.0)


def hb(rank, step=None, event="step"):
    return Heartbeat(pid=100 + rank, rank=rank, time=0.0, event=event, step=step)


def test_one_silent_rank_is_a_hang_while_another_keeps_reporting():
    c = HangClock(P, start=0.0)
    for step in range(1, 5):  # both ranks step every second
        c.heartbeat(hb(0, step), float(step))
        c.heartbeat(hb(1, step), float(step) + 0.1)
    assert c.max_interval == 1.0  # timeout: clamp(10 x 1 s, 5, 50) = 10 s
    for t in range(5, 30):  # rank 0 keeps going (e.g. heartbeats from a side thread)
        c.heartbeat(hb(0, None, "start"), float(t))
        assert c.check(float(t)) is None or t >= 14
    why = c.check(30.0)
    assert why is not None and "rank 1 silent longest" in why


def test_rank_that_stopped_on_purpose_is_not_waited_for():
    c = HangClock(P, start=0.0)
    for step in range(1, 5):
        c.heartbeat(hb(0, step), float(step))
        c.heartbeat(hb(1, step), float(step))
    c.heartbeat(hb(1, None, "stop"), 4.5)
    for t in range(5, 30):
        c.heartbeat(hb(0, t), float(t))
    assert c.check(30.0) is None


def test_single_rank_unchanged():
    c = HangClock(P, start=0.0)
    for step in range(1, 5):
        c.heartbeat(hb(0, step), float(step))
    assert c.check(13.9) is None
    assert c.check(14.0) is not None


def test_ranks_that_stopped_together_name_no_silent_rank():
    c = HangClock(P, start=0.0)
    for step in range(1, 5):  # both stop at step 4, 0.15 s apart (the heartbeat throttle)
        c.heartbeat(hb(0, step), float(step))
        c.heartbeat(hb(1, step), float(step) + 0.15)
    why = c.check(30.0)
    assert why is not None and "silent longest" not in why
