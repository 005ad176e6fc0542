"""One rule for every file rtrain opens in a directory others may write (the run dir, the
checkpoint dir and what rtrain keeps inside them: trackers/, foreign-copy/, the peer registry):
no link followed, regular files only, a non-blocking open, a bounded read. It lives in
`supervisor/core/ownfiles.py` (and, for a checkpoint's own members, `checkpoint/safeio.py`).

The walk below reads the code of every rtrain module and fails on any other way to open a file
by name: a bare `open()`, `os.open`, `Path.open/read_text/read_bytes/write_text/write_bytes/
touch`. What may stay is listed in ALLOWED, each with why; an exclusive create (`O_EXCL`, mode
"x": never through a link, never an existing file) and a directory open (`O_DIRECTORY`) pass as
they are. A new open of a shared-dir file must go through the helpers, or argue its way in here.
Then the planted FIFO that used to hang `rtrain launch` (trackers/mlflow-run), for real."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import REPO, child_env, launch_cmd

# The helpers themselves: where the one rule is written.
HELPERS = {"supervisor/core/ownfiles.py", "checkpoint/safeio.py"}
_ATTRS = {"read_text", "read_bytes", "write_text", "write_bytes", "open", "touch"}

# "file::function" -> why that open is not of a file someone else may have planted.
ALLOWED = {
    # Not a path at all: a zip member, fsspec's remote file, rtrain's own classes and methods.
    "supervisor/ckpt/torchzip.py::_scan_member": "zf.open: a member of an archive already open",
    "supervisor/ckpt/torchzip.py::_check_crc": "zf.open: a member of an archive already open",
    "supervisor/mirror/store.py::Mirror._open_read": "fs.open: the remote store (fsspec)",
    "worker/checkpointer.py::Checkpointer.__init__": "MemoryTier.open: a constructor",
    "checkpoint/st_concat.py::concat": "part.open(): st_concat's own reader (safeio inside)",
    "checkpoint/commit.py::PendingCheckpoint.write_json": "PendingCheckpoint.write_bytes: "
                                                          "exclusive create in its temp dir",
    "worker/memtier/memory_tier.py::write_snapshot": "PendingCheckpoint.write_bytes",
    "supervisor/memtier/persist.py::make_durable": "os.open read-only, no link followed, of "
                                                   "a file rtrain just committed: to fsync it",
    "supervisor/memtier/live_seal.py::_copy_range": "os.open of a file rtrain just moved into "
                                                    "its own 0700 temp dir, checked (_take)",
    "worker/saving/dist_ckpt.py::_write_part": "PendingCheckpoint.write_bytes",
    "worker/saving/save_target.py::write_local": "PendingCheckpoint.write_bytes",
    # The kernel's files (cgroupfs, procfs), which no user can plant.
    "supervisor/proc/cgroup.py::*": "cgroupfs control files",
    "worker/memtier/memory_tier.py::cgroup_room_bytes": "cgroupfs control files",
    "supervisor/proc/spawn.py::_preexec.hook": "the cgroup's cgroup.procs",
    "supervisor/standby/idle.py::read": "procfs: /proc/stat",
    # A parent directory opened to fsync it, right after rtrain renamed into it.
    "supervisor/core/atomic_write.py::write_atomic": "the parent dir, for its fsync",
    "supervisor/commands/exporting.py::_publish": "the parent dir, for its fsync",
    "supervisor/mirror/transfer.py::_sync": "a file or dir rtrain just wrote, for its fsync",
    # Files the user names and owns, which rtrain reads as the user's script would.
    "supervisor/core/config_file.py::_read_toml": "the user's rtrain.toml",
    "checkpoint/hashing.py::read_key_file": "the user's key file (O_NONBLOCK, fstat checked)",
    "supervisor/proc/userkey.py::_read": "the user's own key (O_NOFOLLOW, owner checked)",
    "supervisor/standby/child_program.py::_module_level_imports": "the user's script, which "
                                                                  "the attempt runs anyway",
    "supervisor/standby/child_program.py::compiles": "the user's script and modules",
    "supervisor/standby/child_program.py::_run_script": "the user's script",
    "supervisor/standby/rank_host.py::_read_small": "a rank's error file, opened by the same "
                                                   "rule (the rank host cannot import it)",
    # Already the rule, written out where a FIFO is the file's very purpose.
    "supervisor/proc/control.py::ask_failure_save": "the control FIFO: O_NONBLOCK|O_NOFOLLOW",
    "supervisor/stuck/flight.py::request_dumps": "NCCL's dump pipe: O_NONBLOCK|O_NOFOLLOW",
    "worker/saving/hang_save.py::serve": "its own FIFO, made by the worker (O_NOFOLLOW)",
    "supervisor/ckpt/foreign.py::says_torch_save": "a file's first bytes: O_NONBLOCK|O_NOFOLLOW "
                                                   "after an lstat said regular",
    "supervisor/memtier/registry.py::_open_entry": "the peer registry's own guarded open: "
                                                   "dir_fd, O_NOFOLLOW|O_NONBLOCK, fstat",
    "checkpoint/verified_read.py::ListedFile.__init__": "O_NOFOLLOW|O_NONBLOCK, fstat checked "
                                                        "(a member the manifest lists)",
    # A checkpoint's temp dir, which the writer made itself a moment before.
    "checkpoint/commit.py::PendingCheckpoint.seal_file": "a DCP shard in the writer's temp dir",
    "worker/compilecache/compile_cache.py::collect": "torch's own inductor cache dir",
    # A fault injected on purpose by the test-only guard (RTRAIN_FAULTS).
    "worker/guards/faults.py::_corrupt_newest": "the fault injector's own corruption",
    # The memory tier's own dir in /dev/shm: this user's (`_own_dir` checks owner and type).
    "supervisor/memtier/shmdir.py::drop": "the tier's own dir, owner checked",
    "worker/memtier/shm_files.py::open_existing": "an earlier attempt's file in the tier's own "
                                                  "dir: O_NOFOLLOW|O_NONBLOCK, fstat checked "
                                                  "(regular, this user's, one link)",
}


def _literal(node: ast.AST) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0],
                                                                      ast.Constant):
        return str(node.values[0].value)
    return ""


def _bare_open(call: ast.Call) -> str | None:
    """What kind of open `call` is, when it opens a file by name outside the helpers."""
    fn, args = call.func, call.args
    if isinstance(fn, ast.Name) and fn.id == "open":
        mode = _literal(args[1]) if len(args) > 1 else next(
            (_literal(k.value) for k in call.keywords if k.arg == "mode"), "")
        if "x" in mode or _literal(args[0]).startswith(("/proc/", "/sys/")):
            return None  # an exclusive create; the kernel's files
        return "open()"
    if not isinstance(fn, ast.Attribute):
        return None
    if isinstance(fn.value, ast.Name) and fn.value.id in ("os", "io") and fn.attr == "open":
        flags = {n.attr for a in args[1:2] for n in ast.walk(a) if isinstance(n, ast.Attribute)}
        if flags & {"O_EXCL", "O_DIRECTORY"} or _literal(args[0]).startswith(("/proc/",
                                                                              "/sys/")):
            return None
        return f"{fn.value.id}.open"
    if fn.attr in _ATTRS:
        return f".{fn.attr}()"
    return None


def bare_opens(root: Path, rel: str) -> list[tuple[str, int, str]]:
    """(where, line, what) of each open outside the helpers in one module."""
    found: list[tuple[str, int, str]] = []
    scope: list[str] = []

    class Walk(ast.NodeVisitor):
        def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef
                              | ast.ClassDef) -> None:
            scope.append(node.name)
            self.generic_visit(node)
            scope.pop()

        visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

        def visit_Call(self, node: ast.Call) -> None:
            what = _bare_open(node)
            if what is not None:
                found.append((f"{rel}::{'.'.join(scope) or '<module>'}", node.lineno, what))
            self.generic_visit(node)

    Walk().visit(ast.parse((root / rel).read_text(), filename=rel))
    return found


def _allowed(where: str) -> bool:
    module = where.split("::", 1)[0]
    return where in ALLOWED or f"{module}::*" in ALLOWED


def _modules(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for top in ("supervisor", "worker", "checkpoint")
                  for p in (root / top).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_open_of_a_file_by_name_goes_through_the_helpers():
    offenders = [f"{where} (line {line}): {what}"
                 for rel in _modules(REPO) if rel not in HELPERS
                 for where, line, what in bare_opens(REPO, rel) if not _allowed(where)]
    assert not offenders, ("open these through supervisor/core/ownfiles.py (read_own, open_own, "
                           "own_dir, create_fresh), or add them to ALLOWED with why:\n"
                           + "\n".join(offenders))


def test_the_allow_list_names_only_opens_that_are_there():
    """A stale entry would let a new open in under an old excuse."""
    present = {where for rel in _modules(REPO) if rel not in HELPERS
               for where, _, _ in bare_opens(REPO, rel)}
    modules = {where.split("::", 1)[0] for where in present}
    stale = [k for k in ALLOWED
             if (k not in present if not k.endswith("::*") else k[:-3] not in modules)]
    assert not stale, stale


def test_the_walk_finds_each_kind_of_bare_open(tmp_path):
    """The walk itself: each way to open by name is found, the exempt ones are not."""
    (tmp_path / "m.py").write_text(
        "import os\nfrom pathlib import Path\n"
        "def reader(run_dir):\n"
        "    open(run_dir / 'trackers' / 'mlflow-run')\n"
        "    os.open(run_dir / 'x', os.O_RDONLY)\n"
        "    (run_dir / 'y').read_text()\n"
        "    Path(run_dir, 'z').read_bytes()\n"
        "    (run_dir / 'w').write_text('')\n"
        "    open(run_dir / 'a', mode='rb')\n"
        "def fine(run_dir):\n"
        "    open(run_dir / 'new', 'xb')\n"
        "    os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)\n"
        "    os.open(run_dir / 'n', os.O_WRONLY | os.O_CREAT | os.O_EXCL)\n"
        "    open(f'/proc/{os.getpid()}/stat')\n")
    found = bare_opens(tmp_path, "m.py")
    assert [(where, what) for where, _, what in found] == [
        ("m.py::reader", "open()"), ("m.py::reader", "os.open"), ("m.py::reader", ".read_text()"),
        ("m.py::reader", ".read_bytes()"), ("m.py::reader", ".write_text()"),
        ("m.py::reader", "open()")]


# ------------------------------------------------------------------ a FIFO at trackers/mlflow-run

TRAIN = """\
import os, pathlib, time
pathlib.Path(os.environ["MARK"]).write_text("started")
time.sleep(120)
"""


@pytest.mark.slow
def test_launch_with_a_fifo_at_the_mlflow_record_starts_and_ends_on_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "trackers").mkdir(parents=True)
    os.mkfifo(run_dir / "trackers" / "mlflow-run")
    (tmp_path / "train.py").write_text(TRAIN)
    mark = tmp_path / "started"
    err = tmp_path / "stderr"
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(launch_cmd(run_dir, "train.py"), cwd=tmp_path,
                                env=child_env(MARK=str(mark)), stdout=subprocess.DEVNULL,
                                stderr=stderr, start_new_session=True)
    try:
        deadline = time.monotonic() + 60  # seconds unloaded; the margin is a loaded machine's
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mark.exists(), f"no attempt started: {err.read_text()}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = [ln for ln in err.read_text().splitlines() if "mlflow-run" in ln]
    assert len(said) == 1 and "is a FIFO (named pipe), not a regular file" in said[0], said
    assert code == 75, (code, err.read_text())  # stopped, as at any preemption
    assert (run_dir / "trackers" / "mlflow-run").is_fifo()  # left as it was, never opened


def test_the_mlflow_record_refuses_a_fifo_a_link_and_an_oversized_file(tmp_path):
    from rtrain.supervisor.core import ownfiles
    from rtrain.supervisor.trackers import env as tracker_env

    record = tmp_path / tracker_env.MLFLOW_RECORD
    record.parent.mkdir()
    os.mkfifo(record)
    with pytest.raises(ownfiles.RefusedFile, match="FIFO"):
        tracker_env.read_mlflow_run(tmp_path, "run")  # at once: a blocking open never returns
    record.unlink()
    record.symlink_to(REPO / "README.md")
    with pytest.raises(ownfiles.RefusedFile, match="symbolic link"):
        tracker_env.read_mlflow_run(tmp_path, "run")
    record.unlink()
    record.write_text("run " + "a" * 10_000)
    with pytest.raises(ownfiles.RefusedFile, match="more than an rtrain MLflow run record"):
        tracker_env.read_mlflow_run(tmp_path, "run")


def test_own_dir_refuses_a_link_to_elsewhere_and_a_file(tmp_path):
    from rtrain.supervisor.core import ownfiles

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trackers").symlink_to(elsewhere)
    with pytest.raises(ownfiles.RefusedFile, match="symbolic link"):
        ownfiles.own_dir(tmp_path / "run" / "trackers")
    (tmp_path / "run" / "foreign-copy").write_text("")
    with pytest.raises(ownfiles.RefusedFile, match="not a directory"):
        ownfiles.own_dir(tmp_path / "run" / "foreign-copy")
    ownfiles.own_dir(tmp_path / "new" / "sub", 0o640)
    assert (tmp_path / "new" / "sub").stat().st_mode & 0o777 == 0o750


def test_keep_copy_refuses_a_link_planted_at_foreign_copy(tmp_path):
    """A link at `<run>/foreign-copy` would take the copy (and the removal of the previous
    file's copy) into whatever dir it names."""
    import torch

    from rtrain.checkpoint.verify import Level
    from rtrain.supervisor.ckpt import foreign, keepcopy
    from rtrain.supervisor.core import ownfiles

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"iter_num": 3, "w": torch.zeros(2)}, ckpt / "ckpt.pt")
    v = foreign.verify_path(ckpt / "ckpt.pt", Level.FULL)
    assert v.ok and keepcopy.wants_copy(v)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / keepcopy.KEPT_DIR).symlink_to(elsewhere)
    with pytest.raises(ownfiles.RefusedFile, match="symbolic link"):
        keepcopy.keep(tmp_path / "run", v)
    assert list(elsewhere.iterdir()) == []


def test_a_stack_dump_naming_a_fifo_gets_no_source_line_and_no_wait(tmp_path):
    """A stack dump in the attempt dir names the files of its frames; the stuck-rank report
    reads their lines. A FIFO named there is refused unopened; the user's script through a
    link is still read."""
    from rtrain.supervisor.stuck import collect
    from rtrain.supervisor.stuck.decide import Frame

    os.mkfifo(tmp_path / "pipe.py")
    began = time.monotonic()
    assert collect.source_line(Frame(str(tmp_path / "pipe.py"), 1, "f")) == ""
    assert time.monotonic() - began < 5
    (tmp_path / "train.py").write_text("import os\nstep()  # the hung line\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "train.py")
    assert collect.source_line(Frame(str(tmp_path / "link.py"), 2, "f")) == (
        "step()  # the hung line")
    assert collect.source_line(Frame(str(tmp_path / "link.py"), 9, "f")) == ""
