"""The suite's own rules: a test not marked slow starts no process (so `pytest -m "not slow"`
is a fast loop), and a test that breaks the rule fails even where the code under test caught
the refusal; a child that outlives its timeout fails the test with the stacks of every process
that keeps it from ending, and those are killed."""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import ProcessStart, _no_process_starts
from harness import gone, run_child


class Outcome:
    """What pluggy hands a hookwrapper: the phase's exception, if any, and a way to set one."""

    def __init__(self) -> None:
        self.excinfo = None
        self.forced: BaseException | None = None

    def force_exception(self, exc: BaseException) -> None:
        self.forced = exc


def not_slow_item():
    return SimpleNamespace(get_closest_marker=lambda name: None)


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"]),
    lambda: os.system("true"),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
], ids=["subprocess", "system", "mp-fork", "mp-spawn"])
def test_a_process_start_is_refused_and_fails_the_test_even_when_caught(start):
    guard = _no_process_starts(not_slow_item())
    next(guard)
    try:
        start()
    except ProcessStart:
        pass  # code under test that swallows everything
    outcome = Outcome()
    with pytest.raises(StopIteration):
        guard.send(outcome)
    assert isinstance(outcome.forced, pytest.fail.Exception)
    assert "without @pytest.mark.slow" in str(outcome.forced)


def test_slow_tests_may_start_processes():
    slow = SimpleNamespace(get_closest_marker=lambda name: name == "slow")
    guard = _no_process_starts(slow)
    before = (os.fork, subprocess._fork_exec)
    next(guard)
    assert (os.fork, subprocess._fork_exec) == before  # nothing patched
    with pytest.raises(StopIteration):
        guard.send(Outcome())


@pytest.mark.slow
def test_a_child_past_its_timeout_fails_with_the_stacks_of_whoever_holds_its_output(tmp_path):
    # The child exits at once; the process it forked keeps the child's stdout open, as a
    # DataLoader worker orphaned by a killed training process did: a reader waits for it.
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    def orphaned_and_holding_stdout():\n"
            "        time.sleep(100)\n"
            "    orphaned_and_holding_stdout()\n")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_child([sys.executable, "-c", code], timeout=3)
    said = str(failed.value)
    assert "still running after 3 s" in said
    assert "orphaned_and_holding_stdout" in said  # its Python stack, by py-spy
    pid = int(re.search(r"--- pid (\d+)", said).group(1))
    assert gone(pid), "the orphan was not killed"
