"""Save at a hang (worker/saving/hang_save.py, supervisor/proc/control.py): the request through the
FIFO reaches a reader thread whatever the training thread is doing, and only a request with the
attempt's token is served (others are refused and recorded); a stuck forward commits the last
completed step and the relaunch loses none; stuck after the optimizer step, nothing is saved;
an optimizer step waits while the save reads the state."""

from __future__ import annotations

import os
import subprocess
import textwrap
import threading
import time

import pytest
import torch
from chaos_util import final_state_diff, launch_chaos, reference, replayed_steps, starts, step_log
from chaos_util import write_config as write_chaos_config
from harness import child_env, events, launch_cmd

from rtrain.supervisor.core.protocol import CONTROL_FAILSAVE, CONTROL_FIFO
from rtrain.supervisor.proc.control import ask_failure_save
from rtrain.worker.saving import failsave, hang_save

TOKEN = "5e" * 16


def test_no_reader_no_fifo_or_a_plain_file_is_not_written(tmp_path):
    assert ask_failure_save(tmp_path, TOKEN) is False  # no FIFO: a plain script
    (tmp_path / CONTROL_FIFO).write_text("")
    assert ask_failure_save(tmp_path, TOKEN) is False  # never written into
    assert (tmp_path / CONTROL_FIFO).read_text() == ""
    (tmp_path / CONTROL_FIFO).unlink()
    os.mkfifo(tmp_path / CONTROL_FIFO)
    assert ask_failure_save(tmp_path, TOKEN) is False  # nobody reads it: ENXIO, at once
    assert ask_failure_save(tmp_path, None) is False  # an attempt given no token


def _reader(fifo) -> tuple[threading.Thread, list[bytes]]:
    got: list[bytes] = []

    def read() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t, got


def test_a_fifo_of_another_user_never_receives_the_token(tmp_path):
    fifo = tmp_path / CONTROL_FIFO
    os.mkfifo(fifo, 0o666)
    try:
        os.chown(fifo, 65534, 65534)  # nobody's, as if a teammate swapped it in
    except PermissionError:
        pytest.skip("not root: cannot make a FIFO owned by another user")
    t, got = _reader(fifo)
    time.sleep(0.2)  # the reader has it open: a write would be taken
    assert ask_failure_save(tmp_path, TOKEN) is False
    with open(fifo, "wb"):  # let the reader finish
        pass
    t.join(5)
    assert got == [b""]


def test_a_reader_gets_the_request_with_the_token(tmp_path):
    fifo = tmp_path / CONTROL_FIFO
    os.mkfifo(fifo, 0o600)
    t, got = _reader(fifo)
    deadline = time.monotonic() + 5
    while not ask_failure_save(tmp_path, TOKEN):  # until the reader has opened its end
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t.join(5)
    assert got == [f"\n{CONTROL_FAILSAVE} {TOKEN}\n".encode()]


class _Saver:
    def __init__(self) -> None:
        self.calls = 0

    def save_on_failure(self, exc: BaseException) -> None:
        self.calls += 1
        assert isinstance(exc, hang_save.Hung)


def _write(fifo, data: bytes) -> None:
    with open(fifo, "wb") as f:  # blocks until the serving thread opens its end
        f.write(data)


def _until(cond) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_only_requests_with_the_attempts_token_are_served_the_rest_reported(tmp_path,
                                                                             monkeypatch):
    fifo = tmp_path / CONTROL_FIFO
    os.mkfifo(fifo, 0o600)
    st = os.lstat(fifo)
    sent: list[dict] = []
    monkeypatch.setattr(hang_save.runtime, "heartbeat", lambda **kw: sent.append(kw))
    saver = _Saver()
    t = threading.Thread(target=hang_save.serve, daemon=True,
                         args=(fifo, (st.st_dev, st.st_ino), TOKEN, lambda: [saver],
                               time.monotonic, 0.1))
    t.start()
    _write(fifo, b"failsave\n")  # what rtrain sent before tokens, or anyone's echo
    _until(lambda: len(sent) == 1)
    assert saver.calls == 0
    assert sent == [{"event": "control_refused",
                     "reason": "1 request on control without the attempt's token refused"}]
    _write(fifo, b"failsave " + b"0" * 32 + b"\n" + b"x" * 5000 + b"\n")  # wrong token, junk
    _write(fifo, f"{CONTROL_FAILSAVE} {TOKEN}\n".encode())  # rtrain's request
    _until(lambda: saver.calls == 1)
    assert [s["event"] for s in sent] == ["control_refused", "hang_save_done"]  # reports: 5 s
    os.rename(fifo, tmp_path / "moved")  # someone swaps the FIFO for one of their own
    os.mkfifo(fifo, 0o600)
    t.join(5)  # the thread sees within its poll that the FIFO is not its own, stops reading
    assert not t.is_alive() and saver.calls == 1


ASKS_ITSELF = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from rtrain.worker.saving import hang_save
    from rtrain.worker import runtime
    Path(sys.argv[1]).write_text(os.environ.get("RTRAIN_CONTROL_TOKEN", ""))  # not in the run dir
    runtime.install()
    assert hang_save.start(lambda: [])
    with open(Path(os.environ["RTRAIN_STATUS"]) / "control", "wb") as f:
        f.write(b"failsave\\n")  # a program of the user, not rtrain: no token
    time.sleep(1)
    print("done", flush=True)
""")


@pytest.mark.slow
def test_a_request_rtrain_did_not_make_is_refused_and_recorded(tmp_path):
    script = tmp_path / "asks_itself.py"
    script.write_text(ASKS_ITSELF)
    run = tmp_path / "run"
    r = subprocess.run(launch_cmd(run, str(script), "--", str(tmp_path / "token")),
                       env=child_env(), cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert [(e["attempt"], e["reason"]) for e in events(run, "control_refused")] == [
        (0, "1 request on control without the attempt's token refused")]
    assert events(run, "checkpoint_at_failure") == []
    assert "refused a request on" in (run / "attempts" / "0" / "stderr.log").read_text()
    assert "refused requests rtrain did not make" in r.stderr
    assert (run / "attempts" / "0" / "stdout.log").read_text() == "done\n"
    token = (tmp_path / "token").read_bytes()
    assert len(token) == 32
    for f in run.rglob("*"):  # the token is in no file of the run dir
        if f.is_file():
            assert token not in f.read_bytes(), f


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
