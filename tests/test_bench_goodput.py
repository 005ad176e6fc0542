"""scripts/bench_goodput.py: the kill schedule and the job log's reading (fast), and a --quick
run of rtrain and torchrun with real SIGKILLs that prints the table, rtrain's final state bitwise
equal to the uninterrupted run's (soak: about a minute and a half of training on 2 cores)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from harness import REPO, child_env

SCRIPT = REPO / "scripts" / "bench_goodput.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_goodput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_kill_schedule_is_fixed_by_its_seed_one_kill_in_each_stretch():
    bench = _bench()
    a = bench.kill_schedule(3, 160, 4)
    assert a == bench.kill_schedule(3, 160, 4)
    assert a != bench.kill_schedule(4, 160, 4)
    steps = [s for s, _ in a]
    stretch = (150 - 10) / 4  # the middle of the run, split in 4
    for i, s in enumerate(steps):
        assert 10 + i * stretch < s < 10 + (i + 1) * stretch
    assert all(0 <= f < 1 for _, f in a)


def test_steps_lost_and_recovery_come_from_the_jobs_own_log(tmp_path):
    bench = _bench()
    log = tmp_path / "job.log"
    log.write_text("start 11 100.0 0 memory-tier=off\nstep 1 101.0\nstep 2 102.0\nstep 3 103.0\n"
                   "start 12 106.0 2 memory-tier=off\nstep 3 107.5\nstep 4 108.0\n"
                   "start 13 110.0 4 memory-tier=off\nstep 5 111.0\ndone 112.0 abc\n")
    run = bench.Run("rtrain", 12.0, 0, kills=[103.5, 108.25])
    bench.read_log(log, run)
    assert run.lost() == [1, 0]  # step 3 done, resumed at 2; step 4 done, resumed at 4
    assert run.recovery() == [pytest.approx(4.0), pytest.approx(2.75)]
    assert sorted(run.step_times()) == [0.5, 1.0, 1.0]  # within each process only
    assert run.digest == "abc"


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_quick_run_prints_the_table_and_rtrain_ends_bitwise(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--dir",
                        str(tmp_path / "work"), "--peers-venv", str(tmp_path / "none")],
                       capture_output=True, text=True, env=child_env(), timeout=560)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("tool ")]
    assert head and "goodput" in lines[head[0]], r.stdout
    rows = lines[head[0] + 1:]
    assert [row.split("  ")[0] for row in rows] == ["rtrain (defaults)",
                                                   "torchrun + `torch.save`"], r.stdout
    assert rows[0].rstrip().endswith("bitwise") and "not bitwise" not in rows[0], r.stdout
    assert not (tmp_path / "work").exists()  # the runs' work dir is removed
