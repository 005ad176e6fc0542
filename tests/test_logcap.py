"""Attempt logs are bounded: a real chatty child through `rtrain launch`, a small log cap.

The log keeps its head and its newest output, with a marker of how much was cut between; what
was kept plus what was cut is exactly what the child wrote.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import tuned
from harness import CHILDREN, child_env, launch_cmd

from rtrain.supervisor.proc.logcap import CappedLog

CHATTY = CHILDREN / "chatty.py"


def _check_capped(log: bytes, cap: int, written: int, first: bytes, last: bytes) -> None:
    assert len(log) <= cap + 200, f"{len(log)} bytes kept for a cap of {cap}"
    assert log.startswith(first) and log.endswith(last)
    found = re.search(rb"\n\[rtrain: (\d+) bytes of output cut here: [^\]]*\]\n", log)
    assert found, "no marker of what was cut"
    kept = len(log) - len(found.group(0))
    assert kept + int(found.group(1)) == written
    assert log[found.end():].startswith(first[:4])  # the kept tail starts at a line start


@pytest.mark.slow
@pytest.mark.parametrize("stream", ["out", "err"])
def test_a_chatty_child_log_is_capped_keeping_head_and_tail(tmp_path, stream):
    tuned.write(tmp_path, {"log_cap_mb": 0.25})
    run = tmp_path / "run"
    steps, width = 30000, 200  # 6 MB of output, 24 times the cap
    r = subprocess.run(launch_cmd(run, str(CHATTY), str(steps), str(width), "0", stream),
                       env=child_env(), cwd=tmp_path, capture_output=True, timeout=150)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    log = (run / "attempts" / "0" / f"std{stream}.log").read_bytes()
    _check_capped(log, 2**18, steps * width + len(b"done\n"),
                  b"step 1 x", b"step 30000 " + b"x" * 188 + b"\ndone\n")


def test_uncapped_and_under_the_cap_logs_are_verbatim(tmp_path):
    for cap in (None, 0, 10_000):
        path = tmp_path / f"log-{cap}"
        log = CappedLog(path, cap)
        data = b"".join(f"line {i}\n".encode() for i in range(500))
        for i in range(0, len(data), 7):
            log.write(data[i:i + 7])
        log.close()
        assert path.read_bytes() == data


def test_many_small_writes_past_the_cap(tmp_path):
    path = tmp_path / "log"
    log = CappedLog(path, 4096)
    lines = [f"line {i:05d}\n".encode() for i in range(20000)]
    for line in lines:
        log.write(line)
    log.close()
    _check_capped(path.read_bytes(), 4096, sum(map(len, lines)), b"line 00000\n",
                  b"line 19999\n")
