"""The pure hang clock (by table, with a fake time line) and the datagram receiver."""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from dataclasses import replace

import pytest

from rtrain.supervisor.core import protocol
from rtrain.supervisor.core.protocol import Heartbeat, socket_address
from rtrain.supervisor.proc import senders
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
        # A socket file in a directory only this user may enter: no one else can send.
        assert stat.S_IMODE(os.stat(os.path.dirname(r.name)).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(r.name).st_mode)
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


def test_every_heartbeat_field_has_a_bound():
    """A field added to Heartbeat without a rule in _FIELDS would never be read back."""
    assert set(protocol._FIELDS) == set(Heartbeat.__dataclass_fields__) - {"v"}


@pytest.mark.parametrize("field, value, kept", [
    ("step", 10**30, None), ("step", -1, None), ("step", True, None), ("step", 7, 7),
    ("world", 1 << 21, None), ("world", 0, None), ("world", 8, 8),
    ("max_step_interval", 1e300, None), ("max_step_interval", float("nan"), None),
    ("max_step_interval", 2.5, 2.5), ("step_s", -1.0, None), ("restore_s", "3", None),
    ("loss", float("nan"), "nan"), ("reason", "x" * 10_000, "x" * protocol.MAX_TEXT),
    ("host", 5, None), ("settings", {"batch_size": 8}, {"batch_size": 8}),
    ("settings", {"k": "x" * 5000}, None), ("settings", [1], None),
    ("cadence", {"a": {"b": {"c": {"d": {"e": 1}}}}}, None),
    ("snapshot", {"off": "why"}, {"off": "why"}), ("token", "t" * 65, None),
])
def test_each_field_is_kept_only_with_its_type_within_its_bounds(field, value, kept):
    raw = json.dumps({"v": protocol.PROTOCOL_VERSION, "pid": 5, "rank": 0, "time": 1.0,
                      "event": "step", field: value}).encode()
    got = getattr(Heartbeat.decode(raw), field)
    assert (str(got) if kept == "nan" else got) == kept


@pytest.mark.parametrize("change", [{"pid": 0}, {"rank": -1}, {"rank": 1 << 21}, {"time": "now"},
                                   {"event": "x" * 41}, {"event": "a b"}, {"v": 99}])
def test_a_heartbeat_without_a_valid_sender_rank_time_or_event_is_dropped(change):
    obj = {"v": protocol.PROTOCOL_VERSION, "pid": 5, "rank": 0, "time": 1.0, "event": "step"}
    assert Heartbeat.decode(json.dumps({**obj, **change}).encode()) is None
    assert Heartbeat.decode(b"[1, 2]") is None and Heartbeat.decode(b"[" * 100_000) is None


@pytest.mark.parametrize("uid, pid, token_ok, chain, refused", [
    (1000, 50, True, None, "uid 1000"),  # another user, whatever it carries
    (0, 10, False, None, None),  # the root itself, even after it exited
    (0, 50, True, None, None),  # the attempt's token: a writer gone before it was read
    (0, 50, False, [50, 40, 10, 1], None),  # a descendant of the root
    (0, 50, False, [50, 40, 1], "a process outside the attempt"),
    (0, 50, False, None, "a process that exited before it could be placed"),
])
def test_only_the_attempts_processes_are_heard(uid, pid, token_ok, chain, refused):
    assert senders.refusal(uid=uid, own_uid=0, pid=pid, root=10, token_ok=token_ok,
                           chain=chain) == refused


def test_a_sender_placed_once_is_heard_after_it_exited_and_until_the_next_attempt():
    gate = senders.SenderGate(root=os.getpid(), own_uid=os.geteuid())
    assert gate.admit(os.getpid(), os.geteuid())
    gate.attempt(root=1 << 30, token="s" * 32)  # a new attempt: its own root and token
    assert not gate.admit(os.getpid(), os.geteuid())  # the test process is outside it
    assert gate.admit(os.getpid(), os.geteuid(), "s" * 32)  # ... unless it has the token
    assert gate.admit(os.getpid(), os.geteuid())  # known for the attempt from then on
    assert not gate.admit(os.getpid(), os.geteuid() + 1)  # never for another user
    assert gate.take_refused() == {f"pid {os.getpid()} (a process outside the attempt)": 1,
                                   f"pid {os.getpid()} (uid {os.geteuid() + 1})": 1}


def test_the_socket_dir_goes_with_the_receiver_and_an_abstract_name_stands_in_for_it(
        monkeypatch):
    with HeartbeatReceiver() as r:
        where = os.path.dirname(r.name)
    assert not os.path.exists(where)  # nothing left in the temporary dir

    def no_dir(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tempfile, "mkdtemp", no_dir)
    with HeartbeatReceiver() as r:  # still heard, still only from the attempt's processes
        assert r.name.startswith("@rtrain-")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.sendto(hb(step=3).encode(), socket_address(r.name))
        s.close()
        assert [h.step for h in r.drain()] == [3]
