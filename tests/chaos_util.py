"""Helpers for the end-to-end fault tests (tests/test_chaos_*.py) and scripts/chaos.py.

Each test runs `python -m rtrain launch` on tests/children/chaos_train.py, a small
deterministic training run that logs every step it executes (with its sample ids) and saves its
final model and optimizer state, and compares that with an uninterrupted run of the same script.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import harness
import psutil
import tuned
from bitwise import bitwise_diff
from harness import CHILDREN, child_env, run_child
from references import cached

SCRIPT = CHILDREN / "chaos_train.py"

# The run as configured for the tests: relaunch at once, as often as the faults need, and never
# call repeated deaths before a new checkpoint a crash loop (the kill test does that on purpose).
BASE_CONFIG = {
    "grace_s": 20.0,
    "gpu_release_wait_s": 0.0,
    "restart": {"max_restarts": 1000, "crash_loop_k": 0,
                "budgets": {"crash": 1000, "oom": 10, "hang": 10, "nonfinite": 10, "data": 1}},
    "backoff": {"enabled": False},
}


def _toml_value(v: Any) -> str:
    return json.dumps(v)  # JSON scalars (numbers, strings, booleans) are TOML scalars too


def write_config(path: Path, settings: dict[str, Any], **overrides: Any) -> Path:
    """An rtrain.toml from BASE_CONFIG, `overrides` (merged table by table) and `settings`;
    the tuning constants among them go to tuning.json beside it (tests/tuned.py), where the
    launch run in that directory reads them."""
    cfg: dict[str, Any] = json.loads(json.dumps(BASE_CONFIG))
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    cfg["settings"] = settings
    cfg, constants = tuned.split(cfg)
    tuned.write(path.parent, constants)
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    while tables:
        name, table = tables.pop(0)
        lines.append(f"[{name}]")
        for key, value in table.items():
            if isinstance(value, dict):
                tables.append((f"{name}.{key}", value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def rtrain_cmd(run_dir: Path, *args: str) -> list[str]:
    """`rtrain launch` of the chaos script, whose OUT_DIR is the run dir."""
    return harness.rtrain_cmd("launch", "--run-dir", str(run_dir), "-q", *args, str(SCRIPT),
                              "{run_dir}")


def launch_chaos(run_dir: Path, *args: str, faults: str = "", timeout: float = 150,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_child(rtrain_cmd(run_dir, *args), env=child_env(RTRAIN_FAULTS=faults),
                     cwd=cwd or run_dir.parent, timeout=timeout)


def start_chaos(run_dir: Path, *args: str, faults: str = "", cwd: Path | None = None,
                **kw: Any) -> subprocess.Popen:
    return subprocess.Popen(rtrain_cmd(run_dir, *args), env=child_env(RTRAIN_FAULTS=faults),
                            cwd=cwd or run_dir.parent, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, **kw)


# ------------------------------------------------------------------ reading a run


def step_log(out_dir: Path) -> list[dict[str, Any]]:
    """steps.jsonl; a line torn by a kill is skipped."""
    path = out_dir / "steps.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


class Tail:
    """New complete JSON lines of a growing file, read incrementally (cheap to poll)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


def surviving(log: Iterable[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The steps of the trajectory that produced the final state: every attempt resumes from a
    checkpoint of the trajectory before it and re-executes what followed, so for each step the
    last execution logged is the one that counts."""
    out: dict[int, dict[str, Any]] = {}
    for rec in log:
        if "step" in rec:
            out[rec["step"]] = rec
    return out


def starts(log: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rec for rec in log if "start" in rec]


def replayed_steps(log: Iterable[dict[str, Any]]) -> int:
    """Step executions beyond one per step: the work lost to failures."""
    steps = [rec["step"] for rec in log if "step" in rec]
    return len(steps) - len(set(steps))


def check_exactly_once(traj: dict[int, dict[str, Any]], samples: int, steps: int) -> None:
    """The surviving trajectory's samples are the run's sample stream, each exactly once: global
    indices 0, 1, 2, ... with no gap or repeat, and every epoch a permutation of the dataset."""
    assert sorted(traj) == list(range(1, steps + 1)), "steps missing from the surviving run"
    stream: list[int] = []
    for step in range(1, steps + 1):
        rec = traj[step]
        assert rec["first"] == len(stream), f"step {step} starts at sample {rec['first']}, " \
                                            f"expected {len(stream)}"
        stream += rec["ids"]
    for e in range(len(stream) // samples):
        epoch = stream[e * samples:(e + 1) * samples]
        assert sorted(epoch) == list(range(samples)), f"epoch {e} is not each sample once"
    tail = stream[len(stream) // samples * samples:]
    assert len(set(tail)) == len(tail), "the last, partial epoch repeats a sample"


# ------------------------------------------------------------------ the reference run


PAUSES = ("step_sleep", "forward_sleep", "optimizer_sleep")  # change no value


def reference(base: Path, settings: dict[str, Any], timeout: float = 120) -> Path:
    """OUT_DIR of an uninterrupted run without rtrain, made once per set of values and code
    (references.cached): runs whose settings differ only in a pause (PAUSES: no value changes)
    or in spelling out the default `workers = 0` share one, and it runs without the pauses.
    `base` is unused: the run lives in the suite's reference cache."""
    values = {k: v for k, v in settings.items()
              if k not in PAUSES and not (k == "workers" and v == 0)}

    def make(out: Path) -> None:
        r = run_child([sys.executable, str(SCRIPT), str(out)], cwd=out, timeout=timeout,
                      env=child_env(RTRAIN_SETTINGS=json.dumps(values),
                                    RTRAIN_CKPT_DIR=str(out / "checkpoints")))
        assert r.returncode == 0, r.stderr

    return cached("chaos", values, make)


def final_state_diff(out: Path, ref: Path) -> str | None:
    import torch

    a, b = torch.load(out / "final.pt"), torch.load(ref / "final.pt")
    return bitwise_diff({"model": a["model"], "opt": a["opt"], "step": a["step"]},
                        {"model": b["model"], "opt": b["opt"], "step": b["step"]})


# ------------------------------------------------------------------ processes


def leftovers(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions `marker` (e.g. the run dir).

    This process and its ancestors are not leftovers, even when their command line names the
    marker (`timeout 900 python scripts/chaos.py --dir D` checking under D)."""
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid in mine:
                continue
            if any(marker in part for part in p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def wait_gone(marker: str, timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = leftovers(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def kill_child(pid: int, marker: str) -> bool:
    """SIGKILL `pid` if it is still the training child of this run (never a recycled pid)."""
    try:
        proc = psutil.Process(pid)
        if str(SCRIPT) not in proc.cmdline() or not any(marker in c for c in proc.cmdline()):
            return False
        proc.send_signal(signal.SIGKILL)
        return True
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def wait_for_step(out_dir: Path, step: int, timeout: float = 120.0,
                  proc: subprocess.Popen | None = None) -> dict[str, Any]:
    """Wait until steps.jsonl logs `step` (any attempt); returns that record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rec in step_log(out_dir):
            if rec.get("step", -1) >= step:
                return rec
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"rtrain exited {proc.returncode} before step {step}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} never appeared in {out_dir / 'steps.jsonl'}")
