"""The warm standby against what its preload did, for real: a module of a preloaded package
changed while the standby waits is never run stale (the standby is replaced, or the attempt
starts cold)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from harness import child_env, events

from supervisor.config import Config
from supervisor.launch.standby import Keeper
from supervisor.proc.proctree import TreeSample
from supervisor.proc.spawn import ChildSpec, spawn
from supervisor.records.events import EventLog

pytestmark = pytest.mark.slow


def _run_to_end(child) -> int:
    import select

    pipes = [child.stdout, child.stderr]
    while pipes:
        select.select([p.fd for p in pipes], [], [], 5)
        pipes = [p for p in pipes if p.pump()]
    code = child.popen.wait(30)
    child.close()
    return code


def _sample() -> TreeSample:
    return TreeSample(time.monotonic(), (), 0, 0.0, False, 8 * 2**30, 16 * 2**30)


def _settle(keeper: Keeper) -> None:
    deadline = time.monotonic() + 60
    while keeper.warm is not None and keeper.warm.ready is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
        keeper.tick(_sample())
    assert keeper.warm is not None, "the standby failed"


# ------------------------------------------------------------------ item: stale code

def _package(tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    """mypkg (outside the script's directory, so the default preload imports it) whose
    __init__ imports mypkg.core; the script prints what core says."""
    lib = tmp / "lib" / "mypkg"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("from mypkg import core\n")
    (lib / "core.py").write_text('VALUE = "old"\n')
    app = tmp / "app"
    app.mkdir()
    (app / "train.py").write_text("import mypkg\nprint(mypkg.core.VALUE, flush=True)\n")
    # No bytecode cache: a copy that keeps the size and mtime of the source would otherwise
    # load the old .pyc in a cold start too (Python checks only those two).
    env = child_env(PYTHONPATH=f"{child_env()['PYTHONPATH']}{os.pathsep}{tmp / 'lib'}",
                    PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    return lib / "core.py", app, env


def _change(core: Path, how: str) -> None:
    before = core.stat()
    if how == "edit":
        core.write_text('VALUE = "new"\n')
        return
    # `cp -p` from a tree with old mtimes: same inode, same size, the old mtime kept
    new = core.with_name("core_new.py")
    new.write_text('VALUE = "new"\n')
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    shutil.copy2(new, core)
    new.unlink()
    after = core.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("how, when", [
    ("edit", "while it waits"),
    ("copy keeping the mtime", "while it waits"),
    ("copy keeping the mtime", "just before the hand-off"),
])
def test_a_changed_module_inside_a_preloaded_package_is_never_run_stale(tmp_path, how, when):
    core, app, env = _package(tmp_path)
    log = EventLog(tmp_path / "events.jsonl")
    keeper = Keeper(Config(run_dir=tmp_path), [sys.executable, "train.py"], app, tmp_path, log,
                    say=lambda line: None)

    def spec(attempt: int) -> ChildSpec:
        return ChildSpec(argv=[sys.executable, "train.py"],
                         env={**env, "RTRAIN_ATTEMPT": str(attempt)}, cwd=app,
                         attempt_dir=tmp_path / f"a{attempt}")

    assert keeper.start(spec(0), 0) == (None, 0.0)  # attempt 0 starts cold and trains
    keeper.heartbeat()
    _settle(keeper)
    first = keeper.warm
    assert first.ready["modules"] == ["mypkg"]
    assert str(core) in first.ready["files"]
    time.sleep(0.05)  # past the filesystem's timestamp granularity
    _change(core, how)
    if when == "while it waits":
        keeper._next_stale_check = 0.0  # the periodic check is due
        keeper.tick(_sample())
        assert keeper.warm is None
        keeper.tick(_sample())  # a new one replaces it, with the new code
        _settle(keeper)
        second = keeper.warm
        child, _ = keeper.start(spec(1), 1)
        assert child is not None and child.pid == second.pid != first.pid
        assert _run_to_end(child) == 0
    else:  # the attempt starts before the periodic check: the hand-off checks too
        child, _ = keeper.start(spec(1), 1)
        assert child is None
        child = spawn(spec(1))  # what the loop does then
        assert _run_to_end(child) == 0
    assert (tmp_path / "a1" / "stdout.log").read_text() == "new\n"
    keeper.close()
    log.close()
    [discarded] = events(tmp_path, "standby_discarded")
    assert discarded["pid"] == first.pid
    assert discarded["reason"] == f"changed since it was imported: {core}"
