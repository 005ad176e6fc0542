"""Shared fixtures: checkpoints built without torch (through the real commit protocol), and
helpers for tests that run real child processes (tests/children/*.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from supervisor.ckpt.commit import PendingCheckpoint
from supervisor.ckpt.hashing import alg_for
from supervisor.ckpt.safetensors_io import TensorBlob
from supervisor.proc.spawn import ChildSpec

REPO = Path(__file__).resolve().parent.parent
CHILDREN = Path(__file__).parent / "children"
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
                     **fields: Any) -> Path:
    """Commit `checkpoint-<step>` with tensors (default: a tiny model), a state.json, `files`
    (extra raw files) and manifest `fields` (epoch, samples_seen, ... override the defaults)."""
    pending = PendingCheckpoint(ckpt_dir, step, fsync=False, hash_alg=alg_for(key))
    for name, blobs in (default_tensors(step) if tensors is None else tensors).items():
        pending.write_tensors(name, blobs)
    pending.write_json("state.json", {"step": step})
    for name, data in (files or {}).items():
        pending.write_bytes(name, data)
    manifest = {"epoch": step // 100, "samples_seen": step * 32, "fingerprint": "f" * 32,
                "environment": {"python": "3.11", "torch": None, "rtrain": "0.1.0"},
                "settings": settings if settings is not None else {"batch_size": 32},
                "metrics": {} if metrics is None else metrics, "info": {}, **fields}
    return pending.commit(manifest, key=key)


@pytest.fixture
def make_ckpt():
    """`make_ckpt(dir, step, metrics=..., files=..., tensors=..., key=..., **fields)`."""
    return build_checkpoint


def run_rtrain(*args: str, cwd: str | os.PathLike | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m supervisor ARGS` in a subprocess, as a user would run `rtrain`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    full_env["PYTHONPATH"] = str(REPO)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "supervisor", *args], cwd=cwd or REPO,
                          env=full_env, capture_output=True, text=True, timeout=60)


@pytest.fixture
def rtrain():
    return run_rtrain

def child_spec(tmp_path: Path, script: str, *args: str, **kw) -> ChildSpec:
    env = dict(os.environ)
    env.update(kw.pop("env", {}))
    return ChildSpec(
        argv=[sys.executable, str(CHILDREN / script), *args],
        env=env,
        cwd=CHILDREN,
        attempt_dir=tmp_path / "attempts" / "0",
        **kw,
    )


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
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)
    return path.read_text()


_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@pytest.fixture(autouse=True)
def _isolate_worker_runtime():
    """In-process Checkpointers install the worker's stop handlers in pytest itself; give every
    test the process's original handlers and a fresh runtime state."""
    from worker import runtime

    handlers = {s: signal.getsignal(s) for s in _HANDLED}
    state = runtime._state
    runtime._state = runtime._State()
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    if runtime._state.sock is not None:
        runtime._state.sock.close()
    runtime._state = state


@pytest.fixture
def small_tmpfs(tmp_path):
    """`small_tmpfs("8m")` mounts a tmpfs of that size (a disk that fills up for real) and
    unmounts it after the test; skips with the reason where mounting is refused."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"tmpfs-{size}-{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip() or r.returncode}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)

