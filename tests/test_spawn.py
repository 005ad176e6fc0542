from __future__ import annotations

import os
import select
import sys

import pytest
from harness import child_spec, gone, wait_for

from rtrain.supervisor.proc.spawn import STDERR_TAIL_BYTES, ChildSpec, spawn
from rtrain.supervisor.proc.stop import stop_group


def _run_to_end(child):
    """Drain output until both pipes reach EOF (a full pipe would block the child), then reap."""
    pipes = [child.stdout, child.stderr]
    while pipes:
        select.select([p.fd for p in pipes], [], [], 5)
        pipes = [p for p in pipes if p.pump()]
    child.popen.wait(5)


@pytest.mark.slow
def test_child_runs_in_own_session_with_logs(tmp_path):
    spec = child_spec(tmp_path, "crash_with_code.py", "7", env={"RTRAIN_ATTEMPT": "4"})
    child = spawn(spec)
    try:
        assert child.pgid == child.pid
        assert child.pidfd is not None
        if child.returncode is None:
            assert os.getsid(child.pid) == child.pid
        _run_to_end(child)
    finally:
        child.close()
    assert child.returncode == 7
    assert (spec.attempt_dir / "stdout.log").read_text() == "starting\n"
    assert "RuntimeError: boom" in (spec.attempt_dir / "stderr.log").read_text()
    assert "RuntimeError: boom" in child.stderr.tail_text()


@pytest.mark.slow
def test_env_and_cwd_reach_the_child(tmp_path):
    code = "import os; print(os.environ['RTRAIN_ATTEMPT'], os.getcwd())"
    spec = ChildSpec(
        argv=[sys.executable, "-c", code],
        env={"RTRAIN_ATTEMPT": "2", "PATH": os.environ["PATH"]},
        cwd=tmp_path,
        attempt_dir=tmp_path / "a b\nc",  # quotes and newlines in paths must not matter
    )
    child = spawn(spec)
    _run_to_end(child)
    child.close()
    assert (spec.attempt_dir / "stdout.log").read_text() == f"2 {tmp_path}\n"


@pytest.mark.slow
def test_stderr_tail_is_bounded(tmp_path):
    code = "import sys; sys.stderr.write('x' * 100000 + 'END')"
    spec = ChildSpec(
        argv=[sys.executable, "-c", code],
        env=dict(os.environ),
        cwd=tmp_path,
        attempt_dir=tmp_path / "a",
    )
    child = spawn(spec)
    _run_to_end(child)
    child.close()
    tail = child.stderr.tail_text()
    assert len(tail) == STDERR_TAIL_BYTES and tail.endswith("END")
    assert (spec.attempt_dir / "stderr.log").stat().st_size == 100003


@pytest.mark.slow
def test_echo_tees_to_our_streams(tmp_path, capfd):
    child = spawn(child_spec(tmp_path, "crash_with_code.py", "0", echo=True))
    _run_to_end(child)
    child.close()
    out, err = capfd.readouterr()
    assert "starting" in out and "RuntimeError: boom" in err


@pytest.mark.slow
def test_missing_program_raises_and_leaks_no_fd(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    spec = ChildSpec(argv=["/nonexistent/prog"], env={}, cwd=tmp_path, attempt_dir=tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        spawn(spec)
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.slow
def test_child_dies_with_a_killed_supervisor(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the process that spawned the child; the child dies too."""
    import signal
    import subprocess

    pid_file = tmp_path / "child.pid"
    sup = subprocess.Popen(
        [sys.executable, str(child_spec(tmp_path, "spawn_and_wait.py").argv[1]), str(pid_file)]
    )
    try:
        child_pid = int(wait_for(pid_file))
        assert not gone(child_pid, timeout=0.1)
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        assert gone(child_pid), "the child outlived its SIGKILLed supervisor"
    finally:
        sup.kill()
        sup.wait()


@pytest.mark.slow
def test_joins_the_given_cgroup(tmp_path):
    from rtrain.supervisor.proc.cgroup import limited_v1_group, memory_cgroup

    try:
        cm = limited_v1_group(512 * 1024 * 1024)
        group = cm.__enter__()
    except OSError as err:
        pytest.skip(f"cannot make a cgroup-v1 memory group here: {err}")
    try:
        child = spawn(child_spec(tmp_path, "ignore_sigterm.py", cgroup_dir=group.path))
        try:
            found = memory_cgroup(child.pid)
            assert found is not None and found.path == group.path
        finally:
            stop_group(child, 9, 0)
            child.close()
    finally:
        cm.__exit__(None, None, None)
