"""worker/runtime.py in this process: signals, heartbeats, stack dumps, exit records."""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time

import pytest

from rtrain.supervisor.core.protocol import ExitRecord
from rtrain.supervisor.proc.heartbeat import HeartbeatReceiver
from rtrain.worker import runtime
from rtrain.worker.stuck import progress

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch):
    for name in (
        "RTRAIN_STATUS",
        "RTRAIN_HEARTBEAT",
        "RTRAIN_STOP_SIGNAL",
        "RTRAIN_DUMP_SIGNAL",
        "RTRAIN_ATTEMPT",
        "RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "_state", runtime._State())
    monkeypatch.setattr(progress, "_board", None)
    old = {sig: signal.getsignal(sig) for sig in SIGNALS}
    yield
    for sig, handler in old.items():
        signal.signal(sig, handler)
    faulthandler.unregister(signal.SIGUSR2)
    if runtime._state.sock is not None:
        runtime._state.sock.close()


@pytest.fixture
def receiver(monkeypatch, tmp_path):
    with HeartbeatReceiver() as r:
        monkeypatch.setenv("RTRAIN_HEARTBEAT", r.name)
        monkeypatch.setenv("RTRAIN_STATUS", str(tmp_path))
        yield r


def test_by_hand_sigterm_and_sigusr1_request_a_stop():
    assert not runtime.supervised()
    assert runtime.stop_signals() == [signal.SIGTERM, signal.SIGUSR1]
    # Python's own handler, or SIG_IGN when the tests run in a shell's background job
    ctrl_c = signal.getsignal(signal.SIGINT)
    runtime.install()
    assert not runtime.should_stop()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert runtime.should_stop()
    assert runtime._state.stop_signal == "SIGUSR1"
    assert signal.getsignal(signal.SIGINT) is ctrl_c  # Ctrl-C untouched


def test_by_hand_everything_else_is_a_cheap_no_op(tmp_path):
    runtime.install()
    runtime.heartbeat(step=1, loss=0.1)
    assert runtime.write_exit_record("crash", "boom") is None
    assert runtime.rank() == 0 and runtime.attempt() == 0
    runtime.request_stop()
    assert runtime.should_stop()


def test_supervised_stop_signal_comes_from_env(receiver, monkeypatch):
    monkeypatch.setenv("RTRAIN_STOP_SIGNAL", "USR1")
    assert runtime.supervised()
    assert runtime.stop_signals() == [signal.SIGUSR1]
    runtime.install()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_install_is_idempotent_and_says_start(receiver):
    runtime.install()
    runtime.install()
    assert [hb.event for hb in receiver.drain()] == ["start"]


def test_start_says_when_the_script_began(receiver):
    import time

    import psutil

    # This process's start, from /proc/self/stat: psutil reads the same clock-tick count.
    assert runtime.script_started() == pytest.approx(psutil.Process().create_time(), abs=1.5)
    assert runtime.script_started() < time.time()
    runtime.install()
    [start] = receiver.drain()
    assert start.started == pytest.approx(runtime.script_started(), abs=0.02)


def test_a_process_that_runs_the_script_later_marks_its_start(receiver):
    runtime.mark_script_start(1_800_000_000.5)  # e.g. an interpreter started ahead, handed it
    runtime.install()
    assert [hb.started for hb in receiver.drain()] == [1_800_000_000.5]


def test_step_heartbeats_are_throttled_events_are_not(receiver, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(runtime, "_clock", lambda: now[0])
    runtime.install()
    for step in range(1, 11):  # ten steps of 10 ms: one 0.2 s window
        now[0] += 0.01
        runtime.heartbeat(step=step, loss=1.0, samples=4)
    runtime.heartbeat(event="save_begin", step=10)
    runtime.heartbeat(event="save_end", step=10)
    now[0] += 0.3  # a slow step after warm-up
    runtime.heartbeat(step=11, samples=4, next_save_step=20)
    got = receiver.drain()
    assert [(h.event, h.step) for h in got] == [
        ("start", None),
        ("step", 1),
        ("save_begin", 10),
        ("save_end", 10),
        ("step", 11),
    ]
    last = got[-1]
    assert last.max_step_interval == pytest.approx(0.3)
    assert last.next_save_step == 20
    assert last.samples_per_s == pytest.approx(40 / 0.39)  # samples after the first call


def test_frequent_saves_do_not_starve_step_heartbeats(receiver, monkeypatch):
    # A save every 0.1 s sends save_begin/save_end more often than the step throttle: the step
    # heartbeats (which the hang timeout is learned from) must still go out every 0.2 s.
    now = [100.0]
    monkeypatch.setattr(runtime, "_clock", lambda: now[0])
    runtime.install()
    got = []
    for step in range(1, 101):  # one second of 10 ms steps
        now[0] += 0.01
        runtime.heartbeat(step=step, loss=1.0)
        if step % 10 == 0:
            runtime.heartbeat(event="save_begin", step=step)
            runtime.heartbeat(event="save_end", step=step)
            got += receiver.drain()  # as the supervisor does, before the socket queue fills
    steps = [h.step for h in got if h.event == "step"]
    assert len(steps) >= 4, steps  # one per 0.2 s (floating-point time may drop a fifth)


def _fill(receiver) -> int:
    """Fill the receiver's datagram queue (net.unix.max_dgram_qlen) as a busy supervisor would."""
    from rtrain.supervisor.core.protocol import socket_address
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other:
        for n in range(10_000):
            try:
                other.sendto(b"x", socket.MSG_DONTWAIT, socket_address(receiver.name))
            except BlockingIOError:
                return n
    raise AssertionError("the queue never filled")


def test_an_event_waits_for_room_on_a_full_queue_a_step_does_not(receiver):
    # A supervisor busy elsewhere for a moment (a loaded machine) lets the queue fill; an event
    # (save_skipped, save_begin, stop, exiting) is said once and must not be lost there.
    runtime.install()
    receiver.drain()
    _fill(receiver)
    got: list = []
    reader = threading.Timer(0.3, lambda: got.extend(receiver.drain()))
    reader.start()
    began = time.monotonic()
    runtime.heartbeat(step=7)  # dropped at once: the next step heartbeat says more
    assert time.monotonic() - began < 0.2
    runtime.heartbeat(event="save_skipped", step=8, reason="Read-only file system")
    waited = time.monotonic() - began
    reader.join()
    got += receiver.drain()
    assert [(h.event, h.step) for h in got] == [("save_skipped", 8)]
    assert 0.25 < waited < runtime.EVENT_SEND_WAIT_S


def test_an_event_gives_up_on_a_queue_nobody_reads(receiver, monkeypatch):
    monkeypatch.setattr(runtime, "EVENT_SEND_WAIT_S", 0.3)
    runtime.install()
    _fill(receiver)
    began = time.monotonic()
    runtime.heartbeat(event="save_end", step=8)
    assert 0.3 <= time.monotonic() - began < 2


def test_dump_signal_writes_stacks_to_status_dir(receiver, tmp_path):
    runtime.install()
    os.kill(os.getpid(), signal.SIGUSR2)
    text = (tmp_path / f"stacks-{os.getpid()}.txt").read_text()
    assert "test_dump_signal_writes_stacks_to_status_dir" in text


def test_exit_record_is_written_atomically_per_rank(receiver, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    try:
        raise MemoryError("host ran out")
    except MemoryError as err:
        path = runtime.write_exit_record(
            "oom_host", "out of host memory", step=7, exception=err, settings={"batch_size": 8}
        )
    assert path == tmp_path / "exit-rank2.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit-rank2.json"]
    record = ExitRecord.from_json(path.read_text())
    assert record.kind == "oom_host" and record.rank == 2 and record.step == 7
    assert "MemoryError: host ran out" in record.traceback_tail
    assert record.settings == {"batch_size": 8}


def test_the_last_throttled_step_goes_out_at_exit(receiver):
    runtime.install()
    for step in range(1, 41):  # far faster than the 0.2 s throttle: most are held back
        runtime.heartbeat(step=step, loss=1.0 / step)
    sent = [hb.step for hb in receiver.drain() if hb.event == "step"]
    assert sent and sent[-1] < 40
    runtime._send_held()  # what atexit runs
    last = [hb for hb in receiver.drain() if hb.event == "step"][-1]
    assert last.step == 40 and last.loss == pytest.approx(1 / 40)


def test_stop_stays_the_last_word(receiver):
    runtime.install()
    runtime.heartbeat(step=1)
    runtime.heartbeat(step=2)  # held by the throttle
    runtime.heartbeat(step=2, event="stop")
    runtime._send_held()
    events = [hb.event for hb in receiver.drain()]
    assert events[-1] == "stop"


def test_every_step_reaches_the_progress_board_even_when_its_heartbeat_is_held(
        receiver, tmp_path, monkeypatch):
    from rtrain.supervisor.stuck.collect import read_boards

    monkeypatch.setenv("RANK", "3")
    runtime.install()
    runtime.heartbeat(step=1)
    runtime.step_entered()
    runtime.heartbeat(step=2)  # within the throttle: its heartbeat is held back
    (board,) = read_boards(tmp_path)
    assert (board.rank, board.step, board.entered_at) == (3, 2, None)
    assert [hb.step for hb in receiver.drain() if hb.event == "step"] == [1]
    runtime.step_entered()
    (board,) = read_boards(tmp_path)
    assert board.entered_at is not None and board.entered_at >= board.left_at
