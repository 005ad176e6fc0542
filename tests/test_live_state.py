"""The live state (worker/memtier/live.py, supervisor/memtier/live_seal.py) with real processes:
a SIGKILL outside the optimizer's step loses no step and the run ends bitwise-identical."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from chaos_util import (
    Tail,
    final_state_diff,
    kill_child,
    reference,
    rtrain_cmd,
    starts,
    step_log,
    write_config,
)
from harness import child_env, events

pytestmark = pytest.mark.slow

# A snapshot every 10 steps (Saving(memory=10)): the kill after step 15 finds the newest at 10,
# so only the live state holds step 15.
LIVE = {"save_every": 0, "memory": 10, "steps": 40, "width": 256, "batch_size": 32,
        "forward_sleep": 0.15}


def test_a_sigkill_in_the_forward_resumes_from_the_step_before_it(tmp_path):
    ref = reference(tmp_path, LIVE, timeout=300)
    write_config(tmp_path / "rtrain.toml", LIVE)
    run = tmp_path / "run"
    proc = subprocess.Popen(rtrain_cmd(run), env=child_env(), cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        steps, launches = Tail(run / "steps.jsonl"), Tail(run / "events.jsonl")
        pid, done = None, 0
        deadline = time.monotonic() + 120
        while done < 15 and time.monotonic() < deadline:
            for e in launches.read():
                if e["kind"] == "launch":
                    pid = e["pid"]
            for rec in steps.read():
                done = rec.get("step", done)
            time.sleep(0.01)
        time.sleep(0.06)  # inside the next step's forward (0.15 s of it)
        for rec in steps.read():
            done = rec.get("step", done)
        assert pid is not None and kill_child(pid, str(run))
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    sealed = events(run, "snapshot_sealed")
    assert [e["step"] for e in sealed] == [done], (sealed, done, err[-2000:])
    resumed = {rec["a"]: rec["start"] for rec in starts(step_log(run))}
    assert resumed[1] == done, (resumed, done)
    assert final_state_diff(run, ref) is None
