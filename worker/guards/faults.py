"""Opt-in fault injection for tests and demos; off (and free) unless RTRAIN_FAULTS is set.

    RTRAIN_FAULTS="crash@step=30; oom@batch_size>16; hang@step=50,attempt=1"

One fault per `;`-separated item: `KIND@COND,COND,...` (`KIND` alone is `KIND@step=0`).
Conditions:

    step=N        at the first hook call whose step is >= N (the step given to maybe_save,
                  or to in_step for crash_forward / oom_forward)
    attempt=N     only in attempt N (RTRAIN_ATTEMPT); `attempt=0|2` several, `attempt=*` all.
                  Default: attempt 0 only, so the relaunch recovers
    rank=R        only in rank R (RANK, under torchrun); `rank=1|3` several. Default: all
    count=K       nonfinite only: steps N .. N+K-1 (default 1)
    KNOB>V        oom / oom_step only: while the knob's value exceeds V

Kinds:

    crash           raise RuntimeError("injected crash at step N") from the step hook, after
                    the step's optimizer step: the state has moved past the last boundary
    crash_forward   raise RuntimeError from `in_step(step=n)`, which a script calls inside its
                    forward, at the first step n >= N that is not the first step the process
                    runs (like `crash`, which ends the first step after a resume past N): the
                    optimizer has not stepped, so a save at the failure keeps every completed
                    step
    oom_forward     the same with a CUDA-style out-of-memory error (torch.OutOfMemoryError)
    oom             raise a CUDA-style out-of-memory error (torch.OutOfMemoryError) from the
                    step hook while KNOB > V (read from RTRAIN_SETTINGS and in-process back-off):
                    the process dies and the supervisor degrades
    oom_step        the same from `in_step(batch_size=n)`, which a script calls inside its
                    forward: the in-process back-off (rtrain.OOMBackoff) can catch it
    hang            sleep forever in the step hook; heartbeats stop
    hang_forward    sleep forever in `in_step(step=n)` (the forward), at the step crash_forward
                    would fail: the optimizer has not stepped, so a save at the hang keeps every
                    completed step
    nonfinite       `poison_loss(loss, step)` returns NaN for `count` steps
    kill_in_save    SIGKILL the training process between two files of the first checkpoint
                    written at or after step N
    corrupt_newest  once a checkpoint at or after step N is committed, flip a byte in its
                    model.safetensors, then crash

The spec is parsed once, at import. With nothing to do in this attempt every hook is a module
level no-op (`step_hook is noop`), so the Checkpointer pays one call per step.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtrain.supervisor.core.protocol import ENV_ATTEMPT
from rtrain.worker.settings import current as current_settings

ENV_FAULTS = "RTRAIN_FAULTS"
"""Faults to inject, for trying recovery out: e.g. `crash@step=30; oom@batch_size>16,attempt=1`
(examples/README.md lists them). Off when unset."""
KINDS = ("crash", "crash_forward", "oom", "oom_forward", "oom_step", "hang", "hang_forward",
         "nonfinite", "kill_in_save", "corrupt_newest")
_KNOB_RE = re.compile(r"^([A-Za-z_]\w*)\s*>\s*(-?\d+(?:\.\d+)?)$")
_PID = os.getpid()  # the training process; a forked checkpoint writer kills it, not only itself


class FaultSpecError(ValueError):
    """RTRAIN_FAULTS does not parse; the message is one line saying what to fix."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int = 0
    attempts: frozenset[int] | None = frozenset({0})  # None: every attempt
    count: int = 1
    ranks: frozenset[int] | None = None  # None: every rank
    knob: str | None = None
    above: float | None = None

    def in_attempt(self, attempt: int) -> bool:
        return self.attempts is None or attempt in self.attempts


def _int(item: str, key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise FaultSpecError(f"{ENV_FAULTS}: {key} must be an integer in {item!r}") from None
    if value < 0:
        raise FaultSpecError(f"{ENV_FAULTS}: {key} must not be negative in {item!r}")
    return value


def _parse_one(item: str) -> Fault:
    kind, _, conds = item.partition("@")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"{ENV_FAULTS}: unknown fault kind {kind!r} in {item!r} "
                             f"(known: {', '.join(KINDS)})")
    fields: dict[str, Any] = {}
    for cond in filter(None, (c.strip() for c in conds.split(","))):
        knob = _KNOB_RE.match(cond)
        key, eq, value = cond.partition("=")
        key, value = key.strip(), value.strip()
        if knob:
            if kind not in ("oom", "oom_step"):
                raise FaultSpecError(f"{ENV_FAULTS}: a knob condition applies to oom and "
                                     f"oom_step only, not {kind} in {item!r}")
            fields["knob"], fields["above"] = knob.group(1), float(knob.group(2))
        elif eq and key in ("step", "count"):
            fields[key] = _int(item, key, value)
        elif eq and key == "attempt":
            fields["attempts"] = None if value == "*" else frozenset(
                _int(item, key, v) for v in value.split("|"))
        elif eq and key == "rank":
            fields["ranks"] = frozenset(_int(item, key, v) for v in value.split("|"))
        else:
            raise FaultSpecError(f"{ENV_FAULTS}: cannot read condition {cond!r} in {item!r} "
                                 "(expected step=N, attempt=N, rank=R, count=K or KNOB>V)")
    if "count" in fields and kind != "nonfinite":
        raise FaultSpecError(f"{ENV_FAULTS}: count= applies to nonfinite only, in {item!r}")
    if kind == "oom_step" and "knob" not in fields:
        raise FaultSpecError(f"{ENV_FAULTS}: oom_step needs a size condition such as "
                             f"batch_size>8, in {item!r}")
    if fields.get("count") == 0:
        raise FaultSpecError(f"{ENV_FAULTS}: count must be at least 1 in {item!r}")
    return Fault(kind, **fields)


def parse(spec: str | None) -> list[Fault]:
    """The faults a spec names, in order; raises FaultSpecError with a one-line message."""
    return [_parse_one(item.strip()) for item in (spec or "").split(";") if item.strip()]


# ------------------------------------------------------------------ the hooks


def noop(*args: Any, **kwargs: Any) -> None:
    """What every hook is when no fault is armed for this attempt."""


def identity(loss: Any, step: int) -> Any:
    return loss


def _oom_error(message: str) -> BaseException:
    import torch

    cls = getattr(torch, "OutOfMemoryError", RuntimeError)  # torch >= 2.5
    return cls(message)


def _knob(name: str) -> Any:
    # The supervisor's values for this attempt, then what an in-process back-off settled on.
    from rtrain.worker.guards import degrade

    return degrade.effective_settings(_env_settings).get(name)


def _exceeds(f: Fault, value: Any) -> bool:
    return isinstance(value, (int, float)) and f.above is not None and value > f.above


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


def _corrupt_newest(ckpt_dir: Path, at_least: int) -> Path | None:
    from rtrain.checkpoint.layout import list_checkpoints

    for step, path in list_checkpoints(ckpt_dir):  # newest first
        if step < at_least:
            return None
        target = path / "model.safetensors"
        with open(target, "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last data byte: the header still parses
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
        return path
    return None


def _step_hook(step: int, ckpt_dir: str | os.PathLike | None = None) -> None:
    for f in _armed:
        if step < f.step:
            continue
        if f.kind == "crash":
            raise RuntimeError(f"injected crash at step {step}")
        if f.kind == "hang":
            print(f"rtrain faults: injected hang at step {step}", flush=True)
            _sleep_forever()
        if f.kind == "oom" and (f.knob is None or _exceeds(f, _knob(f.knob))):
            what = f" ({f.knob}={_knob(f.knob)})" if f.knob else ""
            raise _oom_error(f"CUDA out of memory. Tried to allocate 2.00 GiB at step {step}"
                             f"{what} (injected)")
        if f.kind == "corrupt_newest" and ckpt_dir is not None:
            path = _corrupt_newest(Path(ckpt_dir), f.step)
            if path is not None:
                raise RuntimeError(f"injected crash after corrupting {path.name}")


def _in_step(step: int | None = None, **sizes: Any) -> None:
    global _first_step
    if _first_step is None:
        _first_step = step
    for f in _armed:
        if f.kind == "oom_step" and f.knob in sizes and _exceeds(f, sizes[f.knob]):
            raise _oom_error(f"CUDA out of memory. Tried to allocate 2.00 GiB "
                             f"({f.knob}={sizes[f.knob]}) (injected)")
        # Never in the process's first step: a fault that fires before any step completes
        # after every resume makes good checkpoints look poisoned (rtrain quarantines those).
        if step is None or step < f.step or step == _first_step:
            continue
        if f.kind == "crash_forward":
            raise RuntimeError(f"injected crash in the forward of step {step}")
        if f.kind == "oom_forward":
            raise _oom_error(f"CUDA out of memory. Tried to allocate 2.00 GiB in the forward of "
                             f"step {step} (injected)")
        if f.kind == "hang_forward":
            print(f"rtrain faults: injected hang in the forward of step {step}", flush=True)
            _sleep_forever()


def _poison_loss(loss: Any, step: int) -> Any:
    for f in _armed:
        if f.kind == "nonfinite" and f.step <= step < f.step + f.count:
            return loss * float("nan")  # keeps the graph: backward yields NaN gradients too
    return loss


def _on_save_write(step: int) -> None:
    for f in _armed:
        if f.kind == "kill_in_save" and step >= f.step:
            os.kill(_PID, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)  # a forked writer goes with it


def _arm(spec: str | None, attempt: int, rank: int = 0) -> list[Fault]:
    return [f for f in parse(spec)
            if f.in_attempt(attempt) and (f.ranks is None or rank in f.ranks)]


_first_step: int | None = None  # the first step in_step saw in this process
_armed = _arm(os.environ.get(ENV_FAULTS), int(os.environ.get(ENV_ATTEMPT) or 0),
              int(os.environ.get("RANK") or 0))
_env_settings = current_settings() if _armed else {}
_kinds = {f.kind for f in _armed}

step_hook = _step_hook if _kinds & {"crash", "hang", "oom", "corrupt_newest"} else noop
"""Called by Checkpointer.maybe_save(step) with its checkpoint dir, once per step."""
in_step = (_in_step if _kinds & {"oom_step", "crash_forward", "oom_forward", "hang_forward"}
           else noop)
"""Call inside the forward with the step and micro-batch size:
`faults.in_step(step=step, batch_size=len(x))`."""
poison_loss = _poison_loss if "nonfinite" in _kinds else identity
"""`loss = faults.poison_loss(loss, step)`: NaN where a nonfinite fault says so."""
on_save_write = _on_save_write if "kill_in_save" in _kinds else noop
"""Called by the Checkpointer between the tensor files of a save."""
