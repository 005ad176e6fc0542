"""Shared fixtures: checkpoints built without torch (through the real commit protocol), the
`rtrain` CLI, a small disk that fills up, and a check that only tests marked slow start
processes. How tests run processes lives in harness.py."""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import invoke_rtrain

from rtrain.checkpoint import parts, runid
from rtrain.checkpoint.commit import PendingCheckpoint
from rtrain.checkpoint.hashing import alg_for
from rtrain.checkpoint.safetensors_io import TensorBlob
from rtrain.supervisor.core.protocol import ENV_MEMORY_DIR

# The soak tier and --soak (tiers.py); stacks of a hung test's processes, no leftovers (hangs.py);
# the project's bytecode compiled once for every process the tests start (bytecode.py).
pytest_plugins = ["tiers", "hangs", "bytecode"]

NUMPY_TO_ST = {np.dtype("float32"): "F32", np.dtype("float64"): "F64",
               np.dtype("int64"): "I64", np.dtype("int32"): "I32", np.dtype("uint8"): "U8",
               np.dtype("float16"): "F16", np.dtype("bool"): "BOOL"}


def blob(name: str, array: np.ndarray) -> TensorBlob:
    # np.ascontiguousarray would turn a 0-d array into a 1-d one.
    array = np.require(array, requirements='C')
    return TensorBlob(name, NUMPY_TO_ST[array.dtype], tuple(array.shape), memoryview(array))


def default_tensors(step: int) -> dict[str, list[TensorBlob]]:
    rng = np.random.default_rng(step)
    return {"model.safetensors": [
        blob("fc.weight", rng.standard_normal((4, 3)).astype(np.float32)),
        blob("fc.bias", np.zeros(4, np.float32)),
        blob("step", np.array(step, np.int64)),
    ]}


def build_checkpoint(ckpt_dir: str | os.PathLike, step: int, *,
                     metrics: Any = None,
                     files: dict[str, bytes] | None = None,
                     tensors: dict[str, list[TensorBlob]] | None = None,
                     settings: dict[str, Any] | None = None, key: bytes | None = None,
                     state: bool = True, **fields: Any) -> Path:
    """Commit `checkpoint-<step>` with tensors (default: a tiny model), a state.json (unless
    `state=False`), `files` (extra raw files) and manifest `fields` (epoch, samples_seen, ...
    override the defaults)."""
    pending = PendingCheckpoint(ckpt_dir, step, fsync=False, hash_alg=alg_for(key))
    for name, blobs in (default_tensors(step) if tensors is None else tensors).items():
        pending.write_tensors(name, blobs)
    if state:
        pending.write_json("state.json", {"step": step})
    for name, data in (files or {}).items():
        pending.write_bytes(name, data)
    manifest = {"epoch": step // 100, "samples_seen": step * 32, "fingerprint": "f" * 32,
                "environment": {"python": "3.11", "torch": None, "rtrain": "0.1.0"},
                "settings": settings if settings is not None else {"batch_size": 32},
                "metrics": {} if metrics is None else metrics, "info": {}, **fields}
    return pending.commit(manifest, key=key)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A memory-tier directory as rtrain gives one (RTRAIN_MEMORY_DIR), owner-only."""
    d = tmp_path / "shm"
    d.mkdir(mode=0o700)
    monkeypatch.setenv(ENV_MEMORY_DIR, str(d))
    return d


@pytest.fixture
def make_ckpt():
    """`make_ckpt(dir, step, metrics=..., files=..., tensors=..., key=..., **fields)`."""
    return build_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _private_state_home(tmp_path_factory):
    """rtrain's per-user key (supervisor/proc/userkey.py) is made under $XDG_STATE_HOME: the
    suite's own, not the home of whoever runs it; children inherit it (harness.child_env)."""
    old = os.environ.get("XDG_STATE_HOME")
    state = tmp_path_factory.mktemp("state-home")
    state.chmod(0o700)
    os.environ["XDG_STATE_HOME"] = str(state)
    yield
    if old is None:
        os.environ.pop("XDG_STATE_HOME", None)
    else:
        os.environ["XDG_STATE_HOME"] = old


@pytest.fixture
def unsupervised(monkeypatch):
    """No RTRAIN_* in this process's environment for the test: an in-process Checkpointer
    behaves as in a script run without rtrain (no run dir, resume target, settings, keys), even
    when the suite itself runs under a supervisor."""
    for k in [k for k in os.environ if k.startswith("RTRAIN_")]:
        monkeypatch.delenv(k)


@pytest.fixture
def gloo_group(tmp_path, unsupervised):
    """A real process group in this process (gloo, world size 1), with no RTRAIN_* of the run
    that could steer a restore; destroyed after the test."""
    import torch.distributed

    from rtrain.worker import dist

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0,
                                         world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()
        dist.forget_group()


@pytest.fixture
def rtrain():
    """`rtrain(*args, cwd=..., env=...)`: the CLI run in this process (harness.invoke_rtrain).
    Tests about the process itself (what it imports, how it exits under a signal) use
    harness.run_rtrain and are marked slow."""
    return invoke_rtrain


_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _isolate_worker_runtime():
    """In-process Checkpointers install the worker's stop handlers in pytest itself; give every
    test the process's original handlers and a fresh runtime state."""
    from rtrain.worker import runtime

    handlers = {s: signal.getsignal(s) for s in _HANDLED}
    state = runtime._state
    runtime._state = runtime._State()
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if runtime._state.sock is not None:
        runtime._state.sock.close()
    runtime._state = state


_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


@pytest.fixture
def small_tmpfs(tmp_path):
    """`small_tmpfs("8m")` mounts a tmpfs of that size (a disk that fills up for real) and
    unmounts it after the test; skips with the reason where mounting is refused. mount(2) is
    called directly: no `mount` process, so tests that are not slow may use it."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{size}-{len(mounted)}"
        mnt.mkdir()
        if _libc.mount(b"tmpfs", os.fsencode(mnt), b"tmpfs", 0, f"size={size}".encode()) != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {os.strerror(ctypes.get_errno())}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        _libc.umount2(os.fsencode(mnt), _MNT_DETACH)


def remount_read_only(mnt: Path) -> None:
    """Remount a small_tmpfs read-only (writes then fail with EROFS, for root too); skips the
    test where that is refused."""
    ms_rdonly, ms_remount = 1, 32
    if _libc.mount(b"tmpfs", os.fsencode(mnt), b"tmpfs", ms_remount | ms_rdonly, None) != 0:
        pytest.skip(f"cannot remount read-only here: {os.strerror(ctypes.get_errno())}")


class ProcessStart(BaseException):
    """A test not marked slow started a process. A BaseException, so that the code under test
    cannot swallow it with `except Exception`."""


# Every way this code base (and torch, multiprocessing, subprocess) starts a process ends in one
# of these: subprocess through _fork_exec (or posix_spawn), multiprocessing's fork through
# os.fork, its spawn and forkserver through util.spawnv_passfds.
_PROCESS_STARTS = [(subprocess, "_fork_exec"), (os, "fork"), (os, "forkpty"),
                   (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
                   (multiprocessing.util, "spawnv_passfds")]


def _refusing(what: str, started: list[str]):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        started.append(what)
        raise ProcessStart(f"{what}: a test that starts processes must be marked "
                           "@pytest.mark.slow (`pytest -m 'not slow'` starts none)")
    return refuse


def _no_process_starts(item: pytest.Item):
    """Around one phase of a test not marked slow (its fixtures' setup included): starting a
    process raises ProcessStart, and fails the test even where the code under test caught it."""
    if item.get_closest_marker("slow"):
        yield
        return
    started: list[str] = []
    saved = [(owner, name, getattr(owner, name)) for owner, name in _PROCESS_STARTS
             if hasattr(owner, name)]
    for owner, name, _ in saved:
        setattr(owner, name, _refusing(f"{owner.__name__}.{name}", started))
    try:
        outcome = yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    if started and outcome.excinfo is None:
        outcome.force_exception(pytest.fail.Exception(
            f"started a process ({started[0]}) without @pytest.mark.slow", pytrace=False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _no_process_starts(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _no_process_starts(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _no_process_starts(item)


@pytest.fixture(scope="module")
def s3_server():
    """One moto S3 server per test module (s3server.py): starting it costs ~1 s. Not one per
    session: tests that run a watch in this process sweep every descendant of it, the server
    included. Tests that use it are slow (it is a process); each works under its own prefix."""
    from s3server import S3Server

    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_mirror(s3_server, monkeypatch, request):
    """`(url, env)`: an empty prefix of the module's S3 server, with the server's credentials
    and endpoint in os.environ for this test (restored after) and in `env` for children."""
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    if s3_server.proc is None or s3_server.proc.poll() is not None:
        # A test stopped it and failed before restarting it, or restarted it: the server it
        # started was its own process, killed when it ended (tests/hangs.py).
        s3_server.start()
    prefix = f"{request.node.name}-{os.urandom(4).hex()}".replace("[", "-").replace("]", "")
    return f"s3://{s3_server.bucket}/{prefix}", s3_server.env


PART_RUN = "1" * 32
"""The run identity of make_part's parts and of the `ck` fixture's checkpoint dir."""


def make_part(memory_dir: Path, rank: int, world: int, step: int, *, run: str | None = PART_RUN,
              key: bytes | None = None, held: bool = False, model: bool = True) -> Path:
    """A part as a rank writes it: its own files, `info` naming rank and world size, the run
    identity taken from the rank dir. The model file is over a chunk (1 MiB), so it streams;
    `model=False`: the RNG file only, no state.json (a rank other than 0 under DDP)."""
    d = parts.rank_dir(memory_dir, rank, held=held)
    d.mkdir(parents=True, exist_ok=True)
    if run is not None:
        runid.write(d, run)
    rng = np.random.default_rng(step * 10 + rank)
    tensors = {"model.safetensors": [blob("w", rng.standard_normal(300_000).astype(np.float32))],
               f"rng-rank{rank}.safetensors": [blob("state", rng.integers(0, 255, 64,
                                                                         np.uint8))]}
    if not model:
        del tensors["model.safetensors"]
    return build_checkpoint(d, step, key=key, tensors=tensors, state=model,
                            info={"memory_snapshot": True, **parts.part_fields(rank, world)})


@pytest.fixture
def ck(tmp_path):
    """A checkpoint dir of the run PART_RUN, as the peer tests' nodes share it."""
    d = tmp_path / "ck"
    d.mkdir()
    runid.write(d, PART_RUN)
    return d


class PeerEvents:
    """The events and lines of a node's peer side (supervisor/memtier/peerside.py)."""

    def __init__(self) -> None:
        self.got: list[dict] = []
        self.said: list[str] = []

    def emit(self, kind: str, **fields) -> None:
        self.got.append({"kind": kind, **fields})

    def of(self, state: str) -> list[dict]:
        return [e for e in self.got if e["kind"] == "peer_copy" and e["state"] == state]


@pytest.fixture(scope="session")
def shipped(tmp_path_factory):
    """This checkout's wheel and sdist, built once per test process (tests/built.py)."""
    from built import build_checkout

    return build_checkout(tmp_path_factory.mktemp("shipped"))
