"""An S3 endpoint that accepts connections and never answers: every remote call gives up after
its connect and read timeouts (`mirror_connect_timeout_s`, `mirror_read_timeout_s`), and a
launch of a run that already trained says so and trains from its local checkpoints within
seconds, instead of waiting on the store for many minutes."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import tuned

from rtrain.supervisor.config import Config
from rtrain.supervisor.mirror import backend
from tests.harness import CHILDREN, child_env, events, launch_cmd

BIG = str(CHILDREN / "commit_big.py")
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


class Silent:
    """A TCP server on 127.0.0.1 whose backlog completes connections that nobody ever reads
    from or answers: an endpoint that accepts and then stalls."""

    def __enter__(self) -> Silent:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}",
                    "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}
        return self

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def connections(self) -> int:
        """How many connections were made to it: each waits, complete, in the backlog."""
        self.sock.setblocking(False)
        n = 0
        while True:
            try:
                self.sock.accept()[0].close()
            except BlockingIOError:
                return n
            n += 1

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_the_timeouts_are_constants_of_a_few_seconds():
    cfg = Config()
    assert 0 < cfg.mirror_connect_timeout_s <= 10 and 0 < cfg.mirror_read_timeout_s <= 10
    t = backend.Timeouts.of(cfg)
    assert (t.connect_s, t.read_s) == (cfg.mirror_connect_timeout_s, cfg.mirror_read_timeout_s)


def test_the_worst_case_of_one_call_is_stated_and_bounded():
    t = backend.Timeouts()
    # A call that never gets an answer: every try waits the read timeout.
    assert t.worst_case_s() == pytest.approx(
        backend.S3FS_RETRIES * t.attempts * t.read_s, abs=0.01)
    assert t.worst_case_s() <= 30


@pytest.mark.slow  # not a process, but seconds of waiting on purpose
@pytest.mark.soak  # the same timeouts bound the default tier's silent mirror at a relaunch
def test_a_probe_of_a_silent_endpoint_gives_up_within_its_default_timeouts(monkeypatch):
    from rtrain.supervisor.mirror.store import Unreachable, open_mirror

    with Silent() as silent:
        for k, v in silent.env.items():
            monkeypatch.setenv(k, v)
        got: list[BaseException | None] = []

        def probe() -> None:
            try:
                open_mirror("s3://bucket/prefix").probe()
                got.append(None)
            except BaseException as e:  # the test reports what it was
                got.append(e)

        import s3fs  # noqa: F401  (its import, seconds on a loaded machine, is not the wait)

        t0 = time.monotonic()
        worker = threading.Thread(target=probe, daemon=True)
        worker.start()
        worker.join(45)
        elapsed = time.monotonic() - t0
        tries = silent.connections()
    assert got, f"the probe still waits on the silent endpoint after {elapsed:.0f} s"
    assert isinstance(got[0], Unreachable), got
    assert "does not answer" in str(got[0])
    # One connection a try: botocore's retries config counts the first try too.
    assert tries == backend.S3FS_RETRIES * backend.BOTOCORE_ATTEMPTS
    assert elapsed < backend.Timeouts().worst_case_s() + 15


def _stop(proc: subprocess.Popen, timeout: float = 60) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return err


def _wait_launch(run: Path, attempt: int, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until the attempt's `launch` event; fails the test at `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(e["attempt"] == attempt for e in events(run, "launch")):
            return time.monotonic() - t0
        if proc.poll() is not None:
            raise AssertionError(f"rtrain exited {proc.returncode}: {proc.stderr.read()}")
        time.sleep(0.1)
    raise AssertionError(f"attempt {attempt} not launched within {timeout} s: the launch waits "
                         "on the silent mirror")


@pytest.mark.slow
def test_a_silent_mirror_at_a_relaunch_is_reported_and_training_starts(tmp_path):
    run = tmp_path / "run"
    # Timeouts of 1 s: the defaults' bound is the probe test's; this one is about the launch.
    tuned.write(tmp_path, {"mirror_final_wait_s": 2.0, "mirror_connect_timeout_s": 1.0,
                           "mirror_read_timeout_s": 1.0})
    args = (BIG, "{ckpt_dir}", "1", "2", "0.1")
    # The run trains (no mirror yet) and is stopped: a requeue relaunches it.
    proc = subprocess.Popen(launch_cmd(run, *args), cwd=tmp_path,
                            env=child_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (run / "checkpoints" / "checkpoint-2" / "manifest.json").exists():
            assert time.monotonic() < deadline, "the first launch never committed step 2"
            time.sleep(0.1)
    finally:
        _stop(proc)
    with Silent() as silent:
        url = "s3://bucket/prefix"
        proc = subprocess.Popen(launch_cmd(run, "--mirror", url, *args),
                                cwd=tmp_path, env=child_env(**silent.env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            took = _wait_launch(run, 1, proc, timeout=60)
        finally:
            err = _stop(proc)
        assert took < 60
        launched = events(run, "launch")[-1]
        assert launched["resume_from"].endswith("checkpoint-2"), launched  # the local one
        said = [ln for ln in err.splitlines() if "does not answer" in ln]
        assert len(said) >= 1 and "training goes on" in said[0], err
        failed = events(run, "mirror_failed")
        assert failed and "does not answer" in failed[0]["reason"], failed

        # A new run is told at once (exit 2, one line), not after minutes.
        t0 = time.monotonic()
        new = subprocess.run(launch_cmd(tmp_path / "new-run", "--mirror", url, *args),
                             cwd=tmp_path, env=child_env(**silent.env), capture_output=True,
                             text=True, timeout=90)
        took = time.monotonic() - t0
    assert new.returncode == 2 and "does not answer" in new.stderr, new.stderr
    assert took < 60
