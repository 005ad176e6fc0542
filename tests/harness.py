"""How tests run real processes: the child scripts' folder, the environment a child gets, `rtrain`
as a user runs it, reading a run's events, and waiting on pids and files.

Tests that use any of this start processes and are marked `@pytest.mark.slow` (conftest.py
fails a test that starts one without the mark).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from rtrain.checkpoint.layout import list_checkpoints
from rtrain.supervisor.proc.spawn import ChildSpec
from rtrain.supervisor.records.events import EventLog, read_events

REPO = Path(__file__).resolve().parent.parent
CHILDREN = REPO / "tests" / "children"  # the small scripts tests run as children


def child_env(**extra: str) -> dict[str, str]:
    """Our environment for a child: without RTRAIN_* (a supervisor sets those) or torchrun's
    TORCHELASTIC_*, one thread per process (the machine is shared, and
    torch's spinning pool threads make a step of a tiny model 30x slower under load), plus
    `extra`. Without the compile-cache variables too: inductor sets TORCHINDUCTOR_CACHE_DIR in
    its own process the first time it computes its cache dir, so an earlier in-process test
    would hand it to every later child as if a user had set it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTRAIN_", "TORCHELASTIC"))
           and k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _py_spy() -> str | None:
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def process_stacks(procs: list[psutil.Process]) -> str:
    """Every process's command line, state, kernel wait channel and (for Python) stacks."""
    spy = _py_spy()
    out: list[str] = []
    for p in procs:
        try:
            with p.oneshot():
                status = p.status()
                cmd = ("(exited, not reaped)" if status == psutil.STATUS_ZOMBIE
                       else " ".join(p.cmdline())[:300])
            wchan = Path(f"/proc/{p.pid}/wchan").read_text().strip()
        except (psutil.Error, OSError):
            continue
        out.append(f"--- pid {p.pid} ({status}): {cmd}\n    kernel wait channel: {wchan or '-'}")
        if status == psutil.STATUS_ZOMBIE:  # a dead leader whose threads have not all gone
            out.append(_threads(p.pid))
            continue
        if spy is not None and "python" in Path(p.exe() if p.is_running() else "").name:
            try:
                r = subprocess.run([spy, "dump", "--pid", str(p.pid)], capture_output=True,
                                   text=True, timeout=20)
                out.append((r.stdout or r.stderr).rstrip())
            except (subprocess.TimeoutExpired, OSError) as e:
                out.append(f"    py-spy: {e}")
    return "\n".join(out)


def _threads(pid: int) -> str:
    """Each thread's state and kernel wait channel."""
    lines = []
    with contextlib.suppress(OSError):
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with contextlib.suppress(OSError):
                task = f"/proc/{pid}/task/{tid}"
                state = Path(f"{task}/stat").read_text().rpartition(")")[2].split()[0]
                lines.append(f"    thread {tid}: {state} {Path(f'{task}/wchan').read_text()}")
    return "\n".join(lines) or "    no threads left"


def _tree_and_pipe_holders(proc: subprocess.Popen) -> list[psutil.Process]:
    """The child, its descendants, and every other process holding its stdout or stderr open: a
    child that exited can leave an orphan (reparented away from it) that keeps the pipes open,
    and a reader waiting for their end waits on that orphan."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        child = psutil.Process(proc.pid)
        found[child.pid] = child  # even a zombie: what is left of it is shown
        for p in child.children(recursive=True):
            found[p.pid] = p
    pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (proc.stdout, proc.stderr) if f}
    for p in psutil.process_iter():
        if p.pid == os.getpid() or p.pid in found:
            continue
        fd_dir = f"/proc/{p.pid}/fd"
        with contextlib.suppress(OSError):
            if any(os.readlink(f"{fd_dir}/{fd}") in pipes for fd in os.listdir(fd_dir)):
                found[p.pid] = p
    return list(found.values())


def run_child(argv: list[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)`, except
    that a child still running at `timeout` fails the test with the stacks of its whole process
    tree (process_stacks) and the tail of its stderr, where subprocess.run would kill it
    and raise a bare TimeoutExpired: a hang says where it hung."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            tree = _tree_and_pipe_holders(proc)
            stacks = process_stacks(tree)
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.kill()
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(map(str, argv))[:300]}\nstill running after {timeout:.0f} s;"
                        f" stderr ends:\n{err[-2000:]}\nits processes:\n{stacks}",
                        pytrace=False)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def rtrain_cmd(*args: str) -> list[str]:
    """`rtrain ARGS` as an argv: this interpreter running the rtrain command, with the tuning
    constants of a `tuning.json` in its working dir where a test wrote one (tests/tuned.py)."""
    return [sys.executable, str(REPO / "tests" / "tuned.py"), *args]


def launch_cmd(run_dir: str | os.PathLike, *args: str, quiet: bool = True) -> list[str]:
    """`rtrain launch --run-dir RUN_DIR [-q] --no-backoff ARGS` as an argv."""
    return rtrain_cmd("launch", "--run-dir", str(run_dir), *(["-q"] if quiet else []),
                      "--no-backoff", *args)


def run_rtrain(*args: str, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess:
    """`rtrain ARGS` in a subprocess, as a user would run it (cwd: the repository by default);
    `env` adds to child_env()."""
    return run_child(rtrain_cmd(*args), cwd=cwd or REPO, env=child_env(**(env or {})),
                     timeout=timeout)


def invoke_rtrain(*args: str, cwd: str | os.PathLike | None = None,
                  env: dict[str, str] | None = None,
                  timeout: float | None = None) -> subprocess.CompletedProcess:
    """`rtrain ARGS` inside this process (typer's CliRunner), returning what run_rtrain would:
    the exit code and the two streams. The CLI layer is the same code; only the interpreter
    start is left out. `timeout` is accepted for run_rtrain's sake and unused. An exception
    other than the CLI's own exit is raised here, where a subprocess would print a traceback."""
    from typer.testing import CliRunner

    from rtrain.supervisor.cli import app

    environ: dict[str, str | None] = {k: None for k in os.environ
                                       if k.startswith(("RTRAIN_", "TORCHELASTIC"))}
    environ.update(env or {})
    with contextlib.chdir(cwd or REPO):
        result = CliRunner().invoke(app, list(args), env=environ, prog_name="rtrain")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["rtrain", *args], result.exit_code, result.stdout,
                                       result.stderr)


def launch(run_dir: Path, *args: str, env: dict[str, str] | None = None,
           cwd: str | os.PathLike | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess:
    """`rtrain launch --run-dir RUN_DIR -q --no-backoff ARGS`, run to its end in RUN_DIR's
    parent (or `cwd`)."""
    return run_child(launch_cmd(run_dir, *args), cwd=cwd or run_dir.parent,
                     env=child_env(**(env or {})), timeout=timeout)


def run_to_end(child: Any) -> int:
    """Pump a spawned child's output pipes (`proc.spawn` or a warm standby's) until both close;
    its exit code."""
    import select

    pipes = [child.stdout, child.stderr]
    while pipes:
        select.select([p.fd for p in pipes], [], [], 5)
        pipes = [p for p in pipes if p.pump()]
    code = child.popen.wait(30)
    child.close()
    return code


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The run's events (of one `kind` if given); none while events.jsonl does not exist."""
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [e for e in read_events(path) if kind is None or e["kind"] == kind]


def kinds(run_dir: Path) -> list[str]:
    """The kinds of the run's events, in order."""
    return [e["kind"] for e in events(run_dir)]


def child_spec(tmp_path: Path, script: str, *args: str, **kw: Any) -> ChildSpec:
    """A ChildSpec running CHILDREN/script with `args`; `env` adds to our environment."""
    env = dict(os.environ)
    env.update(kw.pop("env", {}))
    return ChildSpec(
        argv=[sys.executable, str(CHILDREN / script), *args],
        env=env,
        cwd=CHILDREN,
        attempt_dir=tmp_path / "attempts" / "0",
        **kw,
    )


def checkpoint_steps(ckpt_dir: str | os.PathLike) -> list[int]:
    """The steps of the checkpoints in `ckpt_dir`, ascending."""
    return sorted(step for step, _ in list_checkpoints(ckpt_dir))


def rank_steps(out: str | os.PathLike, rank: int) -> list[tuple[int, int]]:
    """(attempt, step) of every step rank `rank` executed, in order: the `OUT-rankR.steps` file
    of children/dist_train.py (empty before the rank's first step)."""
    path = Path(f"{out}-rank{rank}.steps")
    text = path.read_text() if path.exists() else ""
    return [tuple(map(int, line.split())) for line in text.splitlines() if line]


def gone(pid: int, timeout: float = 5.0) -> bool:
    """True once `pid` no longer runs (a zombie counts as gone), waiting up to `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def wait_for(path: Path, timeout: float = 10.0) -> str:
    """The text of `path` once it exists; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return path.read_text()


def wait_for_text(path: Path, text: str, timeout: float = 20) -> None:
    """Wait until `path` contains `text`; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.02)
    pytest.fail(f"{text!r} did not appear in {path} within {timeout} s")


def fill_disk(disk: Path) -> Path:
    """Fill the filesystem of `disk` (a small_tmpfs) to the last block with one ballast file;
    unlinking the returned file gives the room back."""
    ballast = disk / "ballast"
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return ballast


def launch_2_ranks(run_dir: Path, *args: str, extra_env: dict[str, str] | None = None,
                   launch_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`rtrain launch --nproc-per-node 2` of children/dist_train.py with its `args` (two gloo
    ranks on CPU; a longer timeout: torchrun and two torch imports on a shared machine)."""
    return launch(run_dir, "--nproc-per-node", "2", *launch_args,
                  str(CHILDREN / "dist_train.py"), *args, env=extra_env, timeout=150)


def read_metrics_text(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The metrics file rtrain writes (metrics/file.py) as {(name, labels): value}: a reader
    for its own output, not a general Prometheus parser."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, rest = head.partition("{")
        labels = []
        rest = rest.rstrip("}")
        while rest:
            key, _, rest = rest.partition('="')
            chars, i = [], 0
            while rest[i] != '"':
                if rest[i] == "\\":
                    i += 1
                    chars.append({"n": "\n"}.get(rest[i], rest[i]))
                else:
                    chars.append(rest[i])
                i += 1
            labels.append((key, "".join(chars)))
            rest = rest[i + 1:].lstrip(",")
        out[(name, frozenset(labels))] = float(value)
    return out


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A real tmpfs of `size` (mount's spelling: "64k") mounted at `where` (created), unmounted
    after; the test is skipped where none can be mounted."""
    import pytest

    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs",
                          str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@contextlib.contextmanager
def memory_cgroup(name: str, limit: int):
    """A real cgroup v1 memory group limited to `limit` bytes (swap too where it is accounted,
    swappiness 0), removed once its processes are gone; skips the test where one cannot be
    made (/sys/fs/cgroup/memory missing or read-only)."""
    cg = Path("/sys/fs/cgroup/memory") / f"{name}-{os.getpid()}-{time.time_ns()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        print(f"skipping: cannot create a cgroup v1 memory group here: {e}")
        pytest.skip(f"cannot create a cgroup v1 memory group here: {e}")
    for knob, value in (("memory.memsw.limit_in_bytes", limit), ("memory.swappiness", 0)):
        try:
            (cg / knob).write_text(str(value))
        except OSError:
            pass  # no swap accounting: the memory limit alone holds without swap
    try:
        yield cg
    finally:
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


T0 = 1_700_000_000.0  # the clock of write_events: T0, T0 + 1, ...


def write_events(run_dir: Path, events: list[tuple[str, dict[str, Any]]]) -> None:
    """Append (kind, fields) events to RUN_DIR/events.jsonl at times T0, T0 + 1, ..."""
    clock = iter(T0 + i for i in range(1000))
    with EventLog(run_dir / "events.jsonl", clock=lambda: next(clock)) as log:
        for kind, fields in events:
            log.emit(kind, **fields)


def fake_scontrol(bin_dir: Path, log: Path) -> None:
    """A stand-in for scontrol that logs its arguments and answers `show job`."""
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1" in
  show) echo "JobId=4242 JobName=t JobState=RUNNING ExcNodeList=gpu-node-2 NodeList=gpu-node-7";;
esac
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def node_cmd(tmp: Path, name: str, port: int, nnodes: str, *args: str) -> list[str]:
    """One simulated node's `rtrain launch` on this machine: one rank, its own run dir
    `run-<name>`, the shared checkpoint dir `ck`, the rendezvous on 127.0.0.1:`port`."""
    return launch_cmd(tmp / f"run-{name}", "--ckpt-dir", str(tmp / "ck"), "--nproc-per-node",
                      "1", "--nnodes", nnodes, "--rdzv-endpoint", f"127.0.0.1:{port}", *args)


def lose_node(sup: subprocess.Popen) -> None:
    """A node lost whole, at once: its supervisor and every process below it SIGKILLed."""
    procs = [psutil.Process(sup.pid), *psutil.Process(sup.pid).children(recursive=True)]
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sup.wait(timeout=10)
    psutil.wait_procs(procs, timeout=10)


def finish_node(sup: subprocess.Popen, err: Path, timeout: float = 300) -> None:
    """The node's rtrain ends with 0 within `timeout` (else it is lost, and the test fails with
    the end of its stderr, `err`)."""
    try:
        rc = sup.wait(timeout=timeout)
    finally:
        if sup.poll() is None:
            lose_node(sup)
    assert rc == 0, err.read_text()[-3000:]
