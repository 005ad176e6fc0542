"""The pure hang clock (by table, with a fake time line) and the datagram receiver."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from rtrain.supervisor.core.protocol import Heartbeat, socket_address
from rtrain.supervisor.proc.heartbeat import HangClock, HangPolicy, HeartbeatReceiver

P = HangPolicy(
    startup_s=100,
    warmup_steps=2,
    multiple=5,
    floor_s=10,
    ceiling_s=60,
    save_allowance_s=300,
    plain_timeout_s=50,
)


def hb(event="step", step=None, **kw):
    return Heartbeat(pid=1, rank=0, time=0.0, event=event, step=step, **kw)


def test_plain_script_hangs_after_silence_without_cpu():
    c = HangClock(P, start=0)
    assert c.check(49) is None
    c.activity(30)  # output or CPU progress
    assert c.deadline() == 80
    assert "no output and no CPU progress" in c.check(80)


def test_startup_allowance_until_warmup_is_over():
    c = HangClock(P, start=0)
    c.heartbeat(hb("start"), 5)
    assert c.deadline() == 105  # heartbeats seen: the plain rule no longer applies
    c.heartbeat(hb(step=1), 50)
    c.heartbeat(hb(step=2), 51)
    c.heartbeat(hb(step=3), 52)
    assert c.max_interval is None and c.deadline() == 152


@pytest.mark.parametrize(
    ("interval", "timeout"),
    [(1.0, 10.0), (4.0, 20.0), (30.0, 60.0)],  # floor, multiple, ceiling
)
def test_learned_timeout_is_clamped(interval, timeout):
    c = HangClock(P, start=0)
    t = 0.0
    for step in range(1, 4):  # warm-up intervals are huge and must not count
        t += 500
        c.heartbeat(hb(step=step), t)
    for step in range(4, 7):
        t += interval
        c.heartbeat(hb(step=step), t)
    assert c.max_interval == pytest.approx(interval)
    assert c.deadline() == pytest.approx(t + timeout)
    assert c.check(t + timeout - 0.01) is None
    assert "learned" in c.check(t + timeout)


def test_worker_reported_interval_counts_after_warmup():
    c = HangClock(P, start=0)
    for step in range(1, 4):
        c.heartbeat(hb(step=step, max_step_interval=8.0), step)
    assert c.max_interval == 8.0


def test_an_exiting_interpreter_gets_the_start_up_allowance():
    c = HangClock(P, start=0)
    for step in range(1, 7):
        c.heartbeat(hb(step=step), step)  # learned: 10 s (floor)
    assert c.deadline() == 16
    c.heartbeat(hb("exiting"), 7)  # atexit: torch's teardown sends nothing for seconds
    assert c.deadline() == 107
    assert c.check(106.9) is None
    assert "has not exited 100.0 s after it began to" in c.check(107)


def test_save_in_progress_gets_its_own_allowance():
    c = HangClock(P, start=0)
    for step in range(1, 7):
        c.heartbeat(hb(step=step), step)  # learned: 10 s (floor)
    c.heartbeat(hb("save_begin", step=6), 7)
    assert c.deadline() == 307
    assert "checkpoint save" in c.check(307)
    c.heartbeat(hb("save_end", step=6), 200)
    assert c.deadline() == 210


def test_policy_rejects_nonsense():
    with pytest.raises(ValueError, match="floor"):
        replace(P, floor_s=10, ceiling_s=5)


def test_receiver_drains_valid_heartbeats_and_drops_garbage():
    with HeartbeatReceiver() as r:
        assert r.name.startswith("@rtrain-")
        assert r.drain() == []
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        addr = socket_address(r.name)
        s.sendto(hb(step=3, loss=0.5).encode(), addr)
        s.sendto(b"not json", addr)
        s.sendto(b'{"v": 99, "pid": 1}', addr)
        s.sendto(hb("save_begin", step=4).encode(), addr)
        s.close()
        got = r.drain()
    assert [(h.event, h.step) for h in got] == [("step", 3), ("save_begin", 4)]
    assert got[0].loss == 0.5


def test_intervals_are_learned_from_one_rank():
    c = HangClock(P, start=0)
    for step in range(1, 8):
        c.heartbeat(Heartbeat(pid=2, rank=1, time=0.0, step=step), step * 4.0 + 0.5)
        c.heartbeat(hb(step=step), step * 4.0)  # rank 0
    assert c.max_interval == 4.0


def test_time_the_supervisor_did_not_run_is_no_silence_nor_a_step_interval():
    c = HangClock(P, start=0)
    for step, t in enumerate((1, 2, 3, 4, 5, 6), start=1):  # learned: 1 s intervals -> 10 s
        c.heartbeat(hb(step=step), t)
    assert c.deadline() == 16
    c.excuse(now=506, gap=500)  # stopped with the whole job from 6 to 506
    assert c.check(506) is None and c.deadline() == 516  # silence starts afresh
    c.heartbeat(hb(step=7), 507)
    assert c.max_interval == pytest.approx(1.0)  # the gap is not a step interval
    assert "no heartbeat" in c.check(517)  # silent after that: hung, as ever
