"""The NCCL flight recorder's setup and collection (supervisor/stuck/flight.py), with scripted
ranks: no GPU here, so a thread plays the rank's monitor that reads its dump pipe and writes
the dump, as ProcessGroupNCCL does."""

from __future__ import annotations

import os
import threading
import time

import pytest

from rtrain.supervisor.stuck import flight


def test_environment_only_on_gpu_and_only_what_the_user_left_unset(tmp_path):
    assert flight.environment({}, tmp_path, gpu=False) == {}
    env = flight.environment({}, tmp_path, gpu=True)
    assert env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path.resolve() / "nccl_trace_rank_"),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path.resolve() / "nccl_trace_pipe_rank_"),
    }
    user = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_FR_DUMP_TEMP_FILE": "/elsewhere/fr_"}
    assert flight.environment(user, tmp_path, gpu=True) == {
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(tmp_path.resolve() / "nccl_trace_pipe_rank_")}


def _scripted_rank(pipe, dump, ready):
    """What a rank's NCCL monitor does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE: make the FIFO,
    read it, and dump its trace when anything is written."""
    os.mkfifo(pipe)
    ready.set()
    with open(pipe, "rb") as f:
        if f.read(1):
            dump.write_bytes(b"\x80\x04flight recorder trace")


def test_a_hang_asks_every_rank_for_its_dump_and_keeps_it(tmp_path):
    env = flight.environment({}, tmp_path, gpu=True)
    ranks = []
    for rank in range(2):
        ready = threading.Event()
        t = threading.Thread(target=_scripted_rank, daemon=True, args=(
            tmp_path / f"nccl_trace_pipe_rank_{rank}.pipe", tmp_path / f"nccl_trace_rank_{rank}",
            ready))
        t.start()
        ranks.append((t, ready))
    for _, ready in ranks:
        assert ready.wait(5)
    t0 = time.time() - 1
    deadline = time.monotonic() + 5
    asked = 0
    while asked < 2 and time.monotonic() < deadline:  # a reader opens its end a moment later
        asked += flight.request_dumps(env)
        time.sleep(0.01)
    assert asked == 2
    for t, _ in ranks:
        t.join(5)
    kept = flight.collect(env, tmp_path, since=t0)
    assert [p.name for p in kept] == ["nccl_trace_rank_0", "nccl_trace_rank_1"]


def test_no_reader_no_request(tmp_path):
    env = flight.environment({}, tmp_path, gpu=True)
    os.mkfifo(tmp_path / "nccl_trace_pipe_rank_0.pipe")  # a rank that is gone
    assert flight.request_dumps(env) == 0
    assert flight.request_dumps({}) == 0


def test_dumps_written_elsewhere_are_copied_in_and_old_ones_left(tmp_path):
    elsewhere, attempt = tmp_path / "fr", tmp_path / "attempt"
    elsewhere.mkdir()
    attempt.mkdir()
    old = elsewhere / "fr_0"
    old.write_bytes(b"an earlier run's")
    os.utime(old, (1000, 1000))
    (elsewhere / "fr_1").write_bytes(b"this attempt's")
    (elsewhere / "fr_2.pipe").write_bytes(b"")
    (elsewhere / "other").write_bytes(b"")
    kept = flight.collect({"TORCH_FR_DUMP_TEMP_FILE": str(elsewhere / "fr_")}, attempt,
                          since=2000)
    assert kept == [attempt / "fr_1"]
    assert (attempt / "fr_1").read_bytes() == b"this attempt's"


@pytest.mark.parametrize("env", [{}, {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/nonexistent/x_"}])
def test_nothing_to_collect(tmp_path, env):
    assert flight.collect(env, tmp_path, since=0) == []
