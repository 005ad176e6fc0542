"""A real kernel OOM kill inside a cgroup-v1 memory limit, seen through the oom_kill counter."""

from __future__ import annotations

import pytest
from harness import child_spec

from rtrain.supervisor.config import Config
from rtrain.supervisor.proc.cgroup import MemoryCgroup, limited_v1_group, memory_cgroup
from rtrain.supervisor.proc.spawn import spawn
from rtrain.supervisor.proc.watch import WatchConfig, watch


def test_counter_parsing(tmp_path):
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 4\n")
    assert MemoryCgroup(tmp_path, 1).oom_kills() == 4
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    assert MemoryCgroup(tmp_path, 2).oom_kills() == 2
    assert MemoryCgroup(tmp_path / "gone", 2).oom_kills() is None


def test_own_cgroup_is_found():
    group = memory_cgroup(1) or memory_cgroup(__import__("os").getpid())
    if group is None:
        pytest.skip("no readable memory cgroup on this machine")
    assert group.oom_kills() is not None


@pytest.mark.slow
def test_cgroup_limit_kill_is_counted(tmp_path):
    try:
        cm = limited_v1_group(100 * 1024 * 1024)
        group = cm.__enter__()
    except OSError as err:
        print(f"skipping: cannot make a cgroup-v1 memory group: {err}")
        pytest.skip(f"cannot make a cgroup-v1 memory group here: {err}")
    try:
        child = spawn(child_spec(tmp_path, "alloc_until_killed.py", cgroup_dir=group.path))
        try:
            outcome = watch(child, WatchConfig.from_config(Config(sample_interval_s=0.1)))
        finally:
            child.close()
    finally:
        cm.__exit__(None, None, None)
    ev = outcome.seen
    assert ev.signal == "SIGKILL", ev
    assert ev.cgroup_oom_kills >= 1
    assert not group.path.exists()
