"""Save at a hang (worker/hang_save.py, supervisor/proc/control.py): the request through the
FIFO reaches a reader thread whatever the training thread is doing; a stuck forward commits the
last completed step and the relaunch loses none; stuck after the optimizer step, nothing is
saved; an optimizer step waits while the save reads the state."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from chaos_util import final_state_diff, launch_chaos, reference, replayed_steps, starts, step_log
from chaos_util import write_config as write_chaos_config
from harness import events

from supervisor.proc.control import ask_failure_save
from supervisor.protocol import CONTROL_FAILSAVE, CONTROL_FIFO
from worker import failsave, hang_save


def test_no_reader_no_fifo_or_a_plain_file_is_not_written(tmp_path):
    assert ask_failure_save(tmp_path) is False  # no FIFO: a plain script
    (tmp_path / CONTROL_FIFO).write_text("")
    assert ask_failure_save(tmp_path) is False  # never written into
    assert (tmp_path / CONTROL_FIFO).read_text() == ""
    (tmp_path / CONTROL_FIFO).unlink()
    os.mkfifo(tmp_path / CONTROL_FIFO)
    assert ask_failure_save(tmp_path) is False  # nobody reads it: ENXIO, at once


def test_a_reader_gets_the_request(tmp_path):
    fifo = tmp_path / CONTROL_FIFO
    os.mkfifo(fifo)
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not ask_failure_save(tmp_path):  # until the reader has opened its end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.join(5)
    assert got == [(CONTROL_FAILSAVE + "\n").encode()]


def test_an_optimizer_step_waits_while_a_save_at_a_hang_reads_the_state():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = failsave.Watch(model, opt, None, None)
    model(torch.ones(1, 2)).sum().backward()
    stepped = threading.Event()

    def step() -> None:
        opt.step()
        stepped.set()

    try:
        with hang_save.hold_steps:
            threading.Thread(target=step, daemon=True).start()
            assert not stepped.wait(0.3)  # held in the pre-hook, before any parameter changed
            assert watch.steps_begun == 1
        assert stepped.wait(5)
    finally:
        watch.close()


SETTINGS = {"steps": 30, "save_every": 8, "keep": 10, "step_sleep": 0.01}
# Generous floors: a loaded machine must not make a resumed attempt look hung. Its steps are
# shorter than the heartbeat throttle, so the hang in the forward is found by the start-up
# allowance (timeout_s) from the last heartbeat.
HANG = {"warmup_steps": 2, "multiple": 4.0, "floor_s": 8.0, "ceiling_s": 8.0, "timeout_s": 15.0}


@pytest.mark.slow
def test_a_hang_in_the_forward_loses_no_step_and_ends_before_the_grace(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    # A grace far longer than the test: the kill must come from the save's end.
    write_chaos_config(tmp_path / "rtrain.toml", SETTINGS, hang=HANG)
    run = tmp_path / "run"
    r = launch_chaos(run, faults="hang_forward@step=13", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c["failure"] for c in events(run, "classification")] == ["hang"]
    saved = events(run, "checkpoint_at_failure")
    assert [(e["attempt"], e["step"], e["exception"]) for e in saved] == [(0, 12, "Hung")]
    # Killed once the save was done, not at the end of the hung child's 15 s grace.
    assert events(run, "exit")[0]["time"] - saved[0]["time"] < 5
    assert events(run, "launch")[1]["resume_from"].endswith("/checkpoint-12")
    log = step_log(run)
    assert [s["start"] for s in starts(log)] == [0, 12]
    assert replayed_steps(log) == 0
    assert final_state_diff(run, ref) is None


@pytest.mark.slow
@pytest.mark.soak  # the hang in the forward is the default tier's
def test_a_hang_after_the_optimizer_step_saves_nothing(tmp_path):
    ref = reference(tmp_path, SETTINGS)
    write_chaos_config(tmp_path / "rtrain.toml", SETTINGS, hang=HANG)
    run = tmp_path / "run"
    r = launch_chaos(run, faults="hang@step=13", timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [c["failure"] for c in events(run, "classification")] == ["hang"]
    assert events(run, "checkpoint_at_failure") == []
    assert "an optimizer step had started" in (run / "attempts" / "0" / "stderr.log").read_text()
    assert events(run, "launch")[1]["resume_from"].endswith("/checkpoint-8")
    assert final_state_diff(run, ref) is None
