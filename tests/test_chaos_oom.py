"""Out of memory for real. The run lives in a cgroup v1 memory group whose
limit the first batch size exceeds (the script touches `mem_mb` MiB per sample of a
micro-batch); the kernel kills the child, rtrain classifies `oom_host`, halves the batch and
doubles the accumulation, and the run finishes having seen every sample of every epoch exactly
once, with the effective batch unchanged."""

from __future__ import annotations

import subprocess

import harness
import pytest
from chaos_util import (
    check_exactly_once,
    rtrain_cmd,
    starts,
    step_log,
    surviving,
    wait_gone,
    write_config,
)
from harness import child_env, events

SAMPLES = 128
SETTINGS = {"batch_size": 32, "grad_accum": 1, "steps": 40, "samples": SAMPLES, "mem_mb": 10,
            "save_every": 4}
# The child is about 320 MiB before its batch: 32 x 10 MiB more is over the limit, 8 x 10 is
# well under (the supervisor, ~50 MiB, shares the group).
LIMIT = 560 << 20


@pytest.fixture
def memory_cgroup():
    with harness.memory_cgroup("rtrain-chaos", LIMIT) as cg:
        yield cg


@pytest.mark.slow
def test_kernel_oom_kill_degrades_and_every_sample_is_seen_once(tmp_path, memory_cgroup):
    write_config(tmp_path / "rtrain.toml", SETTINGS)
    run = tmp_path / "run"
    cmd = " ".join(f"'{a}'" for a in rtrain_cmd(run))
    r = subprocess.run(["sh", "-c", f"echo $$ > {memory_cgroup}/cgroup.procs && exec {cmd}"],
                       env=child_env(), cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]

    cls = events(run, "classification")
    assert cls and all(c["failure"] == "oom_host" for c in cls), cls
    assert "OOM killer" in cls[0]["reason"]
    assert events(run, "exit")[0]["signal"] == "SIGKILL"
    assert len(events(run, "degrade")) == len(cls)
    launches = events(run, "launch")
    sizes = [(e["settings"]["batch_size"], e["settings"]["grad_accum"]) for e in launches]
    assert sizes[0] == (32, 1) and sizes[-1][0] < 32
    assert all(b * a == 32 for b, a in sizes), f"the effective batch changed: {sizes}"

    log = step_log(run)
    assert [s["settings"]["batch_size"] for s in starts(log)] == [b for b, _ in sizes]
    traj = surviving(log)
    assert all(len(rec["ids"]) == 32 for rec in traj.values())
    assert all(rec["bs"] * rec["accum"] == 32 for rec in traj.values())
    check_exactly_once(traj, samples=SAMPLES, steps=SETTINGS["steps"])
    assert wait_gone(str(run)) == []
