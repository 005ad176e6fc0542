"""standby/decide.py by table: when a standby is started, dropped, or used by the next attempt;
and the configuration keys that turn it off or choose what it imports."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from rtrain.supervisor.config import Config
from rtrain.supervisor.core.errors import ConfigError
from rtrain.supervisor.standby import decide as sb
from rtrain.supervisor.standby import idle
from rtrain.supervisor.standby.warm_child import Target, same_target, strip_attempt_vars, target_of

GIB = 2**30


@pytest.mark.parametrize("before, after, changed", [
    ({"A": "1"}, {"A": "1"}, []),
    ({"A": "1", "RTRAIN_ATTEMPT": "0"}, {"A": "1", "RTRAIN_ATTEMPT": "1"}, []),
    ({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}, ["OMP_NUM_THREADS"]),
    ({}, {"CUDA_VISIBLE_DEVICES": "0"}, ["CUDA_VISIBLE_DEVICES"]),
    ({"LD_PRELOAD": "x"}, {}, ["LD_PRELOAD"]),
    ({"PYTORCH_CUDA_ALLOC_CONF": "a", "TORCH_LOGS": "b"},
     {"PYTORCH_CUDA_ALLOC_CONF": "c", "TORCH_LOGS": "d"},
     ["PYTORCH_CUDA_ALLOC_CONF", "TORCH_LOGS"]),
])
def test_import_time_env_changes(before, after, changed):
    assert sb.import_time_env_changes(before, after) == changed


SPAWN = sb.SpawnFacts(enabled=True, failures=0, running_s=10.0, heartbeat_seen=False,
                      host_used=4 * GIB, host_limit=16 * GIB, fraction=0.9, standby_rss=None)


@pytest.mark.parametrize("change, go, why", [
    ({}, True, ""),
    ({"enabled": False}, False, "off"),
    ({"failures": sb.MAX_FAILURES}, False, "2 standbys failed in this launch"),
    ({"running_s": 1.0}, False, "the attempt is starting"),
    ({"running_s": 1.0, "heartbeat_seen": True}, True, ""),
    # a fork from a ready zygote imports nothing: at once, even as the attempt starts
    ({"running_s": 0.0, "zygote_ready": True}, True, ""),
    ({"running_s": 0.0, "zygote_ready": True, "host_used": 14 * GIB}, False,
     "host memory is tight"),
    ({"running_s": 0.0, "zygote_ready": True, "pressure": True}, False,
     "memory pressure rose in this attempt"),
    ({"host_used": 14 * GIB}, False, "host memory is tight"),  # 14 + 0.5 assumed >= 14.4
    ({"host_used": 13 * GIB}, True, ""),
    ({"host_used": 13 * GIB, "standby_rss": 2 * GIB}, False, "host memory is tight"),
    ({"pressure": True}, False, "memory pressure rose in this attempt"),
    # a core idle beside the attempt's start: the zygote imports there, at once
    ({"running_s": 0.25, "idle_core": True}, True, ""),
    ({"running_s": 0.25, "idle_core": True, "host_used": 14 * GIB}, False,
     "host memory is tight"),
])
def test_should_spawn(change, go, why):
    assert sb.should_spawn(replace(SPAWN, **change)) == (go, why)


STAT = """cpu  900 0 300 5000 20 0 0 0 0 0
cpu0 400 0 100 2000 10 0 0 0 0 0
cpu1 500 0 200 3000 10 0 0 0 0 0
intr 1 2 3
"""


def test_idle_cores_reads_each_allowed_cpu_and_counts_iowait_as_idle(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    before = idle.read(str(stat))
    assert before == {0: (2010, 2510), 1: (3010, 3710)}
    # cpu0 busy for all of 100 ticks, cpu1 idle for 80 of 100 (10 of them waiting for I/O)
    stat.write_text(STAT.replace("cpu0 400", "cpu0 500")
                    .replace("cpu1 500 0 200 3000 10", "cpu1 520 0 200 3070 20"))
    assert idle.idle_cores(before, idle.read(str(stat))) == pytest.approx(0.8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {1})  # a cpuset: cpu1 only
    assert set(idle.read(str(stat))) == {1}
    assert idle.read(str(tmp_path / "missing")) == {}
    assert idle.idle_cores(before, before) == 0.0  # no tick passed: nothing known idle
    assert idle.idle_cores({}, before) == 0.0


def test_standby_idle_cores_is_a_number():
    assert Config(run_dir=Path("r")).standby_idle_cores == 0.75
    with pytest.raises(ConfigError, match="standby_idle_cores must be at least 0"):
        Config(run_dir=Path("r"), standby_idle_cores=-1)


USE = sb.UseFacts(ready=True, failed=None, cuda=False, env_changes=(), stale=(),
                  same_target=True)


@pytest.mark.parametrize("change, use, event, reason", [
    ({}, True, "", ""),
    ({"failed": "exited with status 1 while importing"}, False, "standby_failed",
     "exited with status 1 while importing"),
    ({"cuda": True}, False, "standby_failed", "CUDA was initialised while preloading"),
    ({"ready": False}, False, "standby_failed", "not ready"),
    ({"same_target": False}, False, "standby_discarded", "the attempt runs another program"),
    ({"env_changes": ("OMP_NUM_THREADS",)}, False, "standby_discarded",
     "import-time environment changed: OMP_NUM_THREADS"),
    ({"env_changes": tuple("ABCDEFG")}, False, "standby_discarded",
     "import-time environment changed: A, B, C, D, E ..."),
    ({"stale": ("/x/train.py",)}, False, "standby_discarded",
     "changed since it was imported: /x/train.py"),
    # a failure outranks a discard: the event says what went wrong first
    ({"failed": "gone", "env_changes": ("A",)}, False, "standby_failed", "gone"),
])
def test_at_launch(change, use, event, reason):
    assert sb.at_launch(replace(USE, **change)) == sb.Use(use, event, reason)


@pytest.mark.parametrize("stale, tight, why", [
    ((), False, None),
    (("/x/torch/__init__.py",), False, "changed since it was imported: /x/torch/__init__.py"),
    ((), True, "host memory is tight"),
])
def test_while_waiting(stale, tight, why):
    assert sb.while_waiting(stale=stale, tight=tight) == why


SPAWNED, STAMPED = 1_000, 2_000
"""A standby spawned at t=1000 ns recorded its files at t=2000 ns."""
OLD = (1, 77, 100, 500, 500)  # (dev, ino, size, mtime_ns, ctime_ns): last changed before it


@pytest.mark.parametrize("recorded, now, changed", [
    (OLD, OLD, False),
    (OLD, None, True),  # gone
    (OLD, (1, 77, 100, 3_000, 3_000), True),  # edited in place, same size
    (OLD, (1, 77, 100, 500, 3_000), True),  # cp -p / rsync -t over it: only ctime moves
    (OLD, (1, 78, 100, 500, 3_000), True),  # renamed into place with the old mtime
    (OLD, (1, 78, 100, 500, 500), True),  # another inode (say a bind mount swapped)
    (OLD, (2, 77, 100, 500, 500), True),  # another device
    (OLD, (1, 77, 101, 500, 500), True),
    # changed while the standby imported: it may have read the version before
    ((1, 77, 100, 500, 1_500), (1, 77, 100, 500, 1_500), True),
    ((1, 77, 100, 1_000, 1_000), (1, 77, 100, 1_000, 1_000), True),
    # stamped in the future (a file server's clock ahead): unchanged since the record is kept
    ((1, 77, 100, 500, 9_000), (1, 77, 100, 500, 9_000), False),
    ((1, 77, 100, 9_000, 9_000), (1, 77, 100, 9_000, 9_000), False),
])
def test_changed_files(recorded, now, changed):
    got = sb.changed_files({"/x/mypkg/core.py": recorded}, {"/x/mypkg/core.py": now},
                           SPAWNED, STAMPED)
    assert got == (["/x/mypkg/core.py"] if changed else [])


def test_a_copy_that_kept_the_old_mtime_is_a_changed_file(tmp_path):
    """On the real filesystem: `cp -p` over a module (same inode, size and mtime) leaves only
    the ctime to tell, and it does."""
    import shutil

    from rtrain.supervisor.standby.child_program import file_stamp

    core = tmp_path / "core.py"
    core.write_text('VALUE = "old"\n')
    before = core.stat()
    new = tmp_path / "core_new.py"
    new.write_text('VALUE = "new"\n')
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    recorded = file_stamp(str(core))
    spawned = stamped = time.time_ns()
    time.sleep(0.02)  # past the filesystem's timestamp granularity
    shutil.copy2(new, core)
    after = core.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    now = {str(core): file_stamp(str(core))}
    assert sb.changed_files({str(core): recorded}, now, spawned, stamped) == [str(core)]
    assert file_stamp(str(tmp_path / "gone.py")) is None
    assert file_stamp(str(tmp_path)) is None  # not a regular file


def test_the_standby_records_every_file_a_package_runs_from(tmp_path, monkeypatch):
    """Not only the package's top file: the modules its __init__ imports, and the shared
    libraries mapped into the interpreter."""
    from rtrain.supervisor.standby.child_program import imported_files

    pkg = tmp_path / "mypkg_i23"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from mypkg_i23.core import VALUE\n")
    (pkg / "core.py").write_text('VALUE = "old"\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import mypkg_i23  # noqa: F401

        files = imported_files()
    finally:
        for name in ("mypkg_i23", "mypkg_i23.core"):
            sys.modules.pop(name, None)
    assert {str(pkg / "__init__.py"), str(pkg / "core.py")} <= files
    assert any(".so" in os.path.basename(f) for f in files)
    assert all(os.path.isabs(f) for f in files)


@pytest.mark.parametrize("before, after, attempt, started_with", [
    # torch._dynamo sets its cache dir at import: the script finds it set, as in a cold start
    ({}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}, {"A": "1"},
     {"A": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}),
    # an import that overwrites a variable overwrites the attempt's too (the standby is used
    # only when the attempt's value is the one the import saw)
    ({"X": "mine"}, {"X": "lib"}, {"X": "mine"}, {"X": "lib"}),
    ({"X": "mine"}, {}, {"X": "mine", "A": "1"}, {"A": "1"}),  # an import removed it
    ({"X": "mine"}, {"X": "mine"}, {"X": "mine"}, {"X": "mine"}),  # setdefault: nothing
    # RTRAIN_* are the attempt's: the preload never saw them
    ({}, {"RTRAIN_ATTEMPT": "9"}, {"RTRAIN_ATTEMPT": "1"}, {"RTRAIN_ATTEMPT": "1"}),
])
def test_the_attempt_starts_with_what_the_preload_did_to_the_environment(
        before, after, attempt, started_with):
    from rtrain.supervisor.standby.child_program import attempt_environ, env_changes

    assert attempt_environ(attempt, env_changes(before, after)) == started_with


@pytest.mark.parametrize("used, limit, extra, tight", [
    (8, 10, 0, False), (9, 10, 0, True), (8, 10, 1, True), (0, 0, 5, False)])
def test_host_tight(used, limit, extra, tight):
    assert sb.host_tight(used, limit, 0.9, extra) is tight


CWD = Path("/runs/a")


@pytest.mark.parametrize("command, target", [
    (["/v/bin/python", "train.py", "--lr", "1"],
     Target("/v/bin/python", "script", "/runs/a/train.py", "/runs/a", "train.py")),
    (["/v/bin/python3.11", "-m", "pkg.train"],
     Target("/v/bin/python3.11", "module", "pkg.train", "/runs/a", "-m")),
    (["/v/bin/python", "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"], None),
    (["/v/bin/torchrun", "train.py"], None),
    (["/v/bin/python", "-u", "train.py"], None),
    (["/v/bin/python", "train.sh"], None),
    (["bash", "run.sh"], None),
    (["/v/bin/python"], None),
])
def test_target_of(command, target):
    assert target_of(command, CWD) == target


def test_same_target_compares_the_program_not_its_arguments():
    t = target_of(["/v/bin/python", "train.py", "--bs", "8"], CWD)
    assert same_target(t, ["/v/bin/python", "train.py", "--bs", "4"], CWD)
    assert not same_target(t, ["/v/bin/python", "other.py"], CWD)
    assert not same_target(t, ["/w/bin/python", "train.py"], CWD)
    # the same file named otherwise: the preload saw another sys.argv[0]
    assert not same_target(t, ["/v/bin/python", "./train.py"], CWD)


def test_strip_attempt_vars():
    assert strip_attempt_vars({"RTRAIN_ATTEMPT": "1", "PATH": "/bin"}) == {"PATH": "/bin"}


def test_standby_is_on_by_default_and_preload_is_checked():
    assert Config().standby is True and Config().preload is None
    assert Config(preload=["torch", "transformers.models"]).preload == [
        "torch", "transformers.models"]
    for bad, says in [("torch", "must be a list"), (["a b"], "not a module name"),
                      ([3], "not a module name"), (["rtrain.worker"], "cannot be imported before"),
                      (["rtrain.supervisor.cli"], "cannot be imported before")]:
        with pytest.raises(ConfigError, match=says):
            Config(preload=bad)
    with pytest.raises(ConfigError, match="standby must be true or false"):
        Config(standby="yes")


def test_no_standby_and_torchrun_turn_it_off(rtrain, tmp_path):
    from rtrain.supervisor.config import load_config

    assert load_config({"standby": False}, None, tmp_path).standby is False
    (tmp_path / "rtrain.toml").write_text('preload = "torch"\n')
    res = rtrain("launch", "x.py", cwd=tmp_path)
    assert res.returncode == 2 and "preload must be a list" in res.stderr
    assert res.stderr.count("\n") == 1


def test_the_default_preload_is_found_in_the_script_and_its_own_modules(tmp_path):
    from rtrain.supervisor.standby.child_program import top_imports

    (tmp_path / "model.py").write_text("import numpy\nfrom . import x\nimport helpers\n")
    (tmp_path / "helpers.py").write_text("import yaml\nimport model\n")  # a cycle is fine
    (tmp_path / "train.py").write_text(
        "import os, sys\nimport json\nfrom pathlib import Path\nimport model\n"
        "import rtrain\nfrom rtrain.worker import runtime\nimport pytest\nimport no_such_module_x\n"
        "def f():\n    import psutil\n"
        "try:\n    import typer\nexcept ImportError:\n    pass\n")
    found = top_imports(str(tmp_path / "train.py"), str(tmp_path.resolve()))
    # numpy and yaml through the script's own modules; stdlib, rtrain's packages, missing
    # modules and imports inside functions or try blocks are not preloaded
    assert found == ["numpy", "yaml", "pytest"]


def test_a_script_that_imports_no_library_gets_no_standby(tmp_path):
    import sys

    from rtrain.supervisor.standby.warm_child import worth_keeping

    (tmp_path / "plain.py").write_text("import os, json\nimport helper\n")
    (tmp_path / "helper.py").write_text("import sys\n")
    (tmp_path / "uses_numpy.py").write_text("import helper2\n")
    (tmp_path / "helper2.py").write_text("import numpy as np\n")
    plain = target_of([sys.executable, "plain.py"], tmp_path)
    assert not worth_keeping(plain, None)
    assert worth_keeping(plain, ["numpy"])
    assert not worth_keeping(plain, [])
    assert worth_keeping(target_of([sys.executable, "uses_numpy.py"], tmp_path), None)
    assert worth_keeping(target_of([sys.executable, "-m", "uses_numpy"], tmp_path), None)
    assert not worth_keeping(target_of([sys.executable, "-m", "plain"], tmp_path), None)
