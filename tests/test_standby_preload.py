"""The warm standby against what its preload did, for real: a module of a preloaded package
changed while the standby waits is never run stale (the standby is replaced, or the attempt
starts cold), and what a preloaded library did at import (environment variables, signal
handlers, what it saw of sys.argv and __main__) is what a cold start of the same script has.
What still differs (supervisor/standby/child_program.py lists it) is asserted here difference
by difference."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from harness import child_env, events, run_to_end

from rtrain.supervisor.config import Config
from rtrain.supervisor.proc.proctree import TreeSample
from rtrain.supervisor.proc.spawn import ChildSpec, spawn
from rtrain.supervisor.records.events import EventLog
from rtrain.supervisor.standby.slot import StandbySlot
from rtrain.supervisor.standby.warm_child import LOG_NAME, WarmChild, strip_attempt_vars, target_of

pytestmark = pytest.mark.slow


def _sample() -> TreeSample:
    return TreeSample(time.monotonic(), (), 0, 0.0, False, 8 * 2**30, 16 * 2**30)


def _settle(keeper: StandbySlot) -> None:
    """Samples until the standby is ready: forked once its zygote has imported."""
    deadline = time.monotonic() + 60
    while (keeper.warm is None and keeper.zygote is not None) or (
            keeper.warm is not None and keeper.warm.ready is None):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        keeper.tick(_sample())
    assert keeper.warm is not None, "the standby failed"


# ------------------------------------------------------------------ item: stale code

def _package(tmp: Path) -> tuple[Path, Path, dict[str, str]]:
    """mypkg, whose __init__ imports mypkg.core (on the children's PYTHONPATH only); the
    script prints what core says."""
    lib = tmp / "lib" / "mypkg"
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("from mypkg import core\n")
    (lib / "core.py").write_text('VALUE = "old"\n')
    app = tmp / "app"
    app.mkdir()
    (app / "train.py").write_text("import mypkg\nprint(mypkg.core.VALUE, flush=True)\n")
    # No bytecode cache: a copy that keeps the size and mtime of the source would otherwise
    # load the old .pyc in a cold start too (Python checks only those two).
    env = child_env(PYTHONPATH=str(tmp / "lib"),
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
    keeper = StandbySlot(Config(run_dir=tmp_path, preload=["mypkg"]), [sys.executable, "train.py"],
                         app, tmp_path, log, say=lambda line: None)

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
        assert second.zygote.pid != first.zygote.pid  # the stale zygote was replaced too
        assert not Path(f"/proc/{first.zygote.pid}").exists()
        child, _ = keeper.start(spec(1), 1)
        assert child is not None and child.pid == second.pid != first.pid
        assert run_to_end(child) == 0
    else:  # the attempt starts before the periodic check: the hand-off checks too
        child, _ = keeper.start(spec(1), 1)
        assert child is None
        child = spawn(spec(1))  # what the loop does then
        assert run_to_end(child) == 0
    assert (tmp_path / "a1" / "stdout.log").read_text() == "new\n"
    keeper.close()
    log.close()
    [discarded] = events(tmp_path, "standby_discarded")
    assert discarded["pid"] == first.pid
    assert discarded["reason"] == f"changed since it was imported: {core}"


# ------------------------------------------------------------------ item: import-time effects

IMPORTFX = '''\
"""A library that does at import what real ones do: sets, overwrites and removes environment
variables, installs signal handlers, looks at sys.argv, __main__ and the command line, prints."""
import faulthandler
import os
import signal
import sys
import time

with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read()
SEEN = {
    "argv": list(sys.argv),
    "orig_argv": list(sys.orig_argv),
    "main_file": getattr(sys.modules["__main__"], "__file__", None),
    "rtrain_attempt": os.environ.get("RTRAIN_ATTEMPT"),
    "cmdline": cmdline.decode(errors="replace"),
    "at": time.time(),
}
MAIN = sys.modules["__main__"]
os.environ["IMPORTFX_SET"] = "by importfx"
os.environ["IMPORTFX_OVER"] = "by importfx"
os.environ.setdefault("IMPORTFX_DEFAULT", "by importfx")
os.environ.pop("IMPORTFX_DROP", None)


def on_usr2(signum, frame):
    pass


signal.signal(signal.SIGUSR2, on_usr2)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
faulthandler.register(signal.SIGUSR1)  # a handler in C: only SigCgt shows it
print("importfx imported", flush=True)
'''

TRAIN = '''\
import json
import os
import signal
import sys
import time

loaded_first = sorted(sys.modules)
import importfx  # noqa: E402


def name(h):
    if h is None:
        return None
    if isinstance(h, int):
        return signal.Handlers(h).name
    return getattr(h, "__name__", repr(h))


with open("/proc/self/status") as f:
    status = dict(line.rstrip("\\n").split(":\\t", 1) for line in f if ":\\t" in line)
with open("/proc/self/environ", "rb") as f:
    exec_environ = sorted(e.split(b"=", 1)[0].decode() for e in f.read().split(b"\\0") if e)
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read()
with open("/proc/self/stat") as f:
    start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
with open("/proc/stat") as f:
    boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
seen = dict(importfx.SEEN)
record = {
    "environ": dict(os.environ),
    "signals": {s.name: name(signal.getsignal(s)) for s in signal.valid_signals()
                if isinstance(s, signal.Signals)},
    "sig_caught": status["SigCgt"], "sig_ignored": status["SigIgn"],
    "sig_blocked": status["SigBlk"],
    "seen_main_is_main": importfx.MAIN is sys.modules["__main__"],
    "argv": sys.argv,
    # what a warm start still differs in
    "seen": seen,
    "loaded_first": loaded_first,
    "exec_environ": exec_environ,
    "cmdline": cmdline.decode(),
    "started": boot + start_ticks / os.sysconf("SC_CLK_TCK"),
}
with open(sys.argv[1], "w") as f:
    json.dump(record, f)
'''


def _fx_env(tmp: Path, attempt: int) -> dict[str, str]:
    return child_env(PYTHONPATH=str(tmp / "lib"),
                     PYTHONUNBUFFERED="1", RTRAIN_ATTEMPT=str(attempt),
                     IMPORTFX_OVER="attempt", IMPORTFX_DEFAULT="attempt",
                     IMPORTFX_DROP="attempt")


def test_what_a_preloaded_library_did_at_import_is_what_a_cold_start_has(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "importfx.py").write_text(IMPORTFX)
    app = tmp_path / "app"
    app.mkdir()
    (app / "train.py").write_text(TRAIN)
    argv = [sys.executable, "train.py"]
    target = target_of(argv, app)
    warm = WarmChild.spawn(target, strip_attempt_vars(_fx_env(tmp_path, 0)), app, tmp_path,
                           None)  # the default preload: importfx, found in train.py
    warm.wait_ready(60)
    assert warm.failed is None, warm.failed + warm.output_tail()
    assert warm.ready["modules"] == ["importfx"]

    def spec(name: str) -> ChildSpec:
        return ChildSpec(argv=[*argv, str(tmp_path / f"{name}.json"), "two words"],
                         env=_fx_env(tmp_path, 1), cwd=app, attempt_dir=tmp_path / name)

    cold_spawned = time.time()
    assert run_to_end(spawn(spec("cold"))) == 0
    handed_off = time.time()
    assert run_to_end(warm.activate(spec("warm"))) == 0
    cold, warm_rec = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("cold", "warm"))

    # Equal: the environment with the import's changes, the handlers it installed (in Python
    # and in C), what it saw of sys.argv[0] and __main__, the module it kept as __main__.
    for key in ("environ", "signals", "sig_caught", "sig_ignored", "sig_blocked",
                "seen_main_is_main"):
        assert warm_rec[key] == cold[key], key
    assert warm_rec["environ"]["IMPORTFX_SET"] == "by importfx"
    assert warm_rec["environ"]["IMPORTFX_OVER"] == "by importfx"  # it overwrote the attempt's
    assert warm_rec["environ"]["IMPORTFX_DEFAULT"] == "attempt"
    assert "IMPORTFX_DROP" not in warm_rec["environ"]
    assert warm_rec["environ"]["RTRAIN_ATTEMPT"] == "1"
    assert warm_rec["signals"]["SIGUSR2"] == "on_usr2"
    assert warm_rec["signals"]["SIGHUP"] == "SIG_IGN"
    assert warm_rec["seen_main_is_main"] is True
    assert warm_rec["seen"]["main_file"] == cold["seen"]["main_file"] == str(app / "train.py")
    for name, rec in (("cold", cold), ("warm", warm_rec)):
        assert rec["argv"] == ["train.py", str(tmp_path / f"{name}.json"), "two words"]

    # What still differs, as standby/child_program.py lists it:
    # 1. the arguments: the preload ran before the attempt's were known
    assert cold["seen"]["argv"] == ["train.py", str(tmp_path / "cold.json"), "two words"]
    assert warm_rec["seen"]["argv"] == ["train.py"]
    assert warm_rec["seen"]["orig_argv"] == [sys.executable, "train.py"]
    # 2. no RTRAIN_* variable at import
    assert (cold["seen"]["rtrain_attempt"], warm_rec["seen"]["rtrain_attempt"]) == ("1", None)
    # 3. the command line read at import is the standby's
    assert "standby/child_program.py" in warm_rec["seen"]["cmdline"]
    assert "standby/child_program.py" not in cold["seen"]["cmdline"]
    # 4. the preloaded modules are there from the first line, imported (and the process
    #    started) before the attempt
    extra = set(warm_rec["loaded_first"]) - set(cold["loaded_first"])
    assert "importfx" in extra and "importfx" not in cold["loaded_first"]
    std = sys.stdlib_module_names
    assert {m for m in extra if m.split(".")[0] not in std} == {"importfx"}
    assert warm_rec["seen"]["at"] < cold_spawned < cold["seen"]["at"] < handed_off
    assert warm_rec["started"] < cold["started"]
    # 5. what it printed while importing is in standby.log, not the attempt's log
    assert "importfx imported" in (tmp_path / "cold" / "stdout.log").read_text()
    assert "importfx imported" not in (tmp_path / "warm" / "stdout.log").read_text()
    assert "importfx imported" in (tmp_path / LOG_NAME).read_text()
    # 6. /proc/<pid>/environ is the kernel's copy from its exec: no RTRAIN_*
    assert "RTRAIN_ATTEMPT" in cold["exec_environ"]
    assert "RTRAIN_ATTEMPT" not in warm_rec["exec_environ"]
    # 7. /proc/<pid>/cmdline: the words joined by spaces (an argument's own space is lost)
    assert cold["cmdline"].split("\0") == [*spec("cold").argv, ""]
    assert warm_rec["cmdline"].split("\0")[0] == " ".join(spec("warm").argv)


def test_a_preloaded_module_run_with_dash_m_sees_its_file_as_argv0(tmp_path):
    """`python -m app_main`: at its imports sys.argv[0] is the module's file (runpy sets it)."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "importfx.py").write_text(IMPORTFX)
    app = tmp_path / "app"
    app.mkdir()
    (app / "app_main.py").write_text(TRAIN)
    argv = [sys.executable, "-m", "app_main"]
    warm = WarmChild.spawn(target_of(argv, app), strip_attempt_vars(_fx_env(tmp_path, 0)),
                           app, tmp_path, None)
    warm.wait_ready(60)
    assert warm.failed is None, warm.failed + warm.output_tail()
    out = tmp_path / "warm.json"
    child = warm.activate(ChildSpec(argv=[*argv, str(out)], env=_fx_env(tmp_path, 1),
                                    cwd=app, attempt_dir=tmp_path / "warm"))
    assert run_to_end(child) == 0
    rec = json.loads(out.read_text())
    assert warm.ready["modules"] == ["importfx"]
    assert rec["seen"]["argv"] == [str(app / "app_main.py")]
    assert rec["seen"]["orig_argv"] == [sys.executable, "-m", "app_main"]
    assert rec["seen"]["main_file"] == str(app / "app_main.py")
    assert rec["seen_main_is_main"] is True
    assert rec["argv"] == [str(app / "app_main.py"), str(out)]
    assert rec["signals"]["SIGUSR2"] == "on_usr2"



def test_rtrain_reads_no_attempt_variable_at_import_but_where_it_rebinds(tmp_path):
    """A warm standby imports rtrain's worker modules (`rtrain._WARM`) before the attempt's
    RTRAIN_* variables exist, and `rtrain._rebind_attempt` reads them again only where a module
    reads them at import (faults, check_order). Any other module that read one would keep what
    the zygote saw: every variable read while importing them is listed, and must be one of those."""
    probe = (
        "import json, os, sys\n"
        "read = set()\n"
        "class Env(dict):\n"
        "    def get(self, k, d=None):\n"
        "        read.add(k); return super().get(k, d)\n"
        "    def __getitem__(self, k):\n"
        "        read.add(k); return super().__getitem__(k)\n"
        "    def __contains__(self, k):\n"
        "        read.add(k); return super().__contains__(k)\n"
        "import torch, torch._dynamo\n"
        "os.environ = Env(os.environ)\n"
        "import importlib, rtrain\n"
        "for n in rtrain._WARM: importlib.import_module(n)\n"
        "print(json.dumps(sorted(k for k in read if k.startswith('RTRAIN_') or k == 'RANK')))\n")
    import subprocess

    out = subprocess.run([sys.executable, "-c", probe], env=child_env(), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    from rtrain.supervisor.core.protocol import ENV_ATTEMPT, ENV_CHECK_RESUME
    from rtrain.worker.guards.faults import ENV_FAULTS

    rebound = {ENV_FAULTS, ENV_ATTEMPT, "RANK", ENV_CHECK_RESUME}
    assert set(json.loads(out.stdout)) <= rebound, out.stdout
