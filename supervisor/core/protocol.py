"""The wire between worker and supervisor (contract 1 and 2), torch-free and shared by both.

- `RTRAIN_STATUS` is the attempt directory `<run-dir>/attempts/<n>/`. The worker writes its exit
  record there (`exit-rank<R>.json`), keeps its progress board there (`progress-rank<R>.bin`,
  core/progress_board.py) and, on `RTRAIN_DUMP_SIGNAL`, writes its Python stacks there
  (`stacks-<pid>.txt`, via faulthandler).
- `RTRAIN_HEARTBEAT` names a unix datagram socket the supervisor listens on: a socket file in
  a directory only its user may enter ("@name", the Linux abstract namespace, where that cannot
  be made). Each datagram is one JSON heartbeat. Sends never block: when nobody listens, the
  heartbeat is dropped. The supervisor reads only datagrams whose kernel-checked sender is of
  its user and in the attempt's process tree (proc/senders.py), and every field of one is
  untrusted: `Heartbeat.decode` keeps only fields of their type within bounds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

PROTOCOL_VERSION = 1

# Each ENV_* name below is set by rtrain in the training process's environment (contract 1); the
# docstring after it is its meaning as docs/reference.md shows it (scripts/gen_reference.py).
ENV_RUN_DIR = "RTRAIN_RUN_DIR"
"""The run directory (absolute)."""
ENV_CKPT_DIR = "RTRAIN_CKPT_DIR"
"""Where checkpoints go (absolute): `--ckpt-dir`, by default `<run-dir>/checkpoints`; the
Checkpointer's default `ckpt_dir`, and `{ckpt_dir}` in the script's arguments."""
ENV_RESUME_FROM = "RTRAIN_RESUME_FROM"
"""The verified checkpoint to resume from (absolute; `{checkpoint}` in the arguments); unset
for a fresh start."""
ENV_ATTEMPT = "RTRAIN_ATTEMPT"
"""0 for the first launch, +1 per relaunch, continued across requeues."""
ENV_SETTINGS = "RTRAIN_SETTINGS"
"""JSON object: this attempt's knob values (`[settings]` and `--set`, lowered by the ladder),
read by `rtrain.settings()`."""
ENV_STATUS = "RTRAIN_STATUS"
"""The attempt directory `<run-dir>/attempts/<n>/`: the worker's exit record, progress board and
stack dumps go there."""
ENV_STOP_SIGNAL = "RTRAIN_STOP_SIGNAL"
"""The signal the worker treats as "save at the next step boundary and exit 75" (`stop_signal`,
default SIGTERM)."""
ENV_HEARTBEAT = "RTRAIN_HEARTBEAT"
"""The unix datagram socket rtrain listens on for heartbeats: a path in a directory only the
user may enter (`@name`, Linux's abstract namespace, where none can be made); a send never
blocks, and rtrain reads only what the attempt's own processes send."""
ENV_DUMP_SIGNAL = "RTRAIN_DUMP_SIGNAL"
"""The signal on which the worker writes every Python stack to `$RTRAIN_STATUS/stacks-<pid>.txt`
(at a hang)."""
ENV_GENERATION = "RTRAIN_GENERATION"
"""The attempt's checkpoint generation (checkpoint/generation.py): a commit made under an earlier
attempt's token is refused, so a writer left behind cannot commit."""
ENV_RUN_ID = "RTRAIN_RUN_ID"
"""The run identity (32 hex digits, checkpoint/runid.py), the same in every attempt of the run,
after a requeue and on a fresh machine resuming from the mirror: experiment trackers continue one
run under it (trackers/env.py, worker/trackers/restarts.py)."""
ENV_TRACKER_VARS = "RTRAIN_TRACKER_VARS"
"""The names of the trackers' own variables rtrain set for the attempt (comma-separated:
`WANDB_RUN_ID`, `WANDB_RESUME`, `MLFLOW_RUN_ID`), so the worker's tracker helpers know which
ones the user chose and which they may override."""
ENV_FAILURES = "RTRAIN_FAILURES"
"""The run's failures so far that lost work, for the save cadence of `every="auto"`
(worker/saving/cadence.py); unset when events.jsonl cannot be read."""
ENV_RUN_SECONDS = "RTRAIN_RUN_SECONDS"
"""Seconds the run's attempts have run so far: with RTRAIN_FAILURES, the observed time between
failures."""
ENV_SAVE_COST = "RTRAIN_SAVE_COST"
"""The save cost the run last measured (JSON {"save_stall_s", "step_time_s"}, from the newest
`cadence` event): a relaunch chooses its first interval from it instead of guessing."""
ENV_CHECK_RESUME = "RTRAIN_CHECK_RESUME"
"""Set only by `rtrain check-resume` (JSON {"stop_at": step or null, "stop": "kill", "signal" or
null, "entropy": a seed or absent}): `import rtrain` seeds python's and numpy's global
generators with the entropy (worker/checkresume/check_order.py); the Checkpointer records
evidence of inexact resumes in each manifest's info.check_resume, stops where asked and saves
the final step (worker/checkresume/resume_check.py)."""
ENV_RELIEVE_SIGNAL = "RTRAIN_RELIEVE_SIGNAL"
"""The signal (SIGURG) with which rtrain asks the worker to free memory at its next step
boundary (memory pressure)."""
ENV_MEMORY_DIR = "RTRAIN_MEMORY_DIR"
"""The memory tier's directory (supervisor/memtier/): an owner-only directory in shared memory
(/dev/shm) where `Saving(memory=...)` commits snapshots in the checkpoint format, which rtrain
persists to the checkpoint dir when the child dies and resumes from without a disk read. A file
`dropped` in it says rtrain dropped the tier (memory pressure): no more snapshots."""
MEMORY_DROPPED = "dropped"
LIVE_DIR = "live"
"""In the memory dir: the live state (worker/memtier/live.py), the parameters and optimizer
state kept in mapped files; rtrain seals it into a snapshot once its writer is gone
(supervisor/memtier/live_seal.py)."""
LIVE_MARK = "mark.json"
"""In LIVE_DIR: present exactly while the directory holds one whole step (its step, writer pid
and manifest fields)."""
LIVE_LAYOUT = "layout.json"
"""In LIVE_DIR: the mapped files' tensors and sizes, and the tied names' byte ranges."""
ENV_MEMORY_RESUME = "RTRAIN_MEMORY_RESUME"
"""With RTRAIN_MEMORY_DIR: "1" when a process group may resume from its ranks' parts in the
memory dir newer than RTRAIN_RESUME_FROM; "0" on a rollback (the newer state may be the bad one)
and when the user named the checkpoint (--resume PATH)."""
# A FIFO the worker creates in its status dir (RTRAIN_STATUS) and reads from a thread of its
# own: requests that must be served while the training thread is stuck (worker/saving/hang_save.py).
# Each request is one line, `<what> <token>`: the worker serves only those that carry
# RTRAIN_CONTROL_TOKEN, a secret of the attempt that rtrain hands it in its environment alone
# (never in the run dir), and reports any other as a `control_refused` heartbeat.
CONTROL_FIFO = "control"
CONTROL_FAILSAVE = "failsave"  # save the last step boundary if nothing changed since
ENV_CONTROL_TOKEN = "RTRAIN_CONTROL_TOKEN"
"""The attempt's secret (new per attempt, in its environment alone): the worker serves a request
on its control FIFO (a save at a hang) only when the request carries it, and sends it with each
heartbeat, so rtrain knows the attempt's own even from a process already gone."""

DUMP_SIGNAL = "SIGUSR2"  # RTRAIN_DUMP_SIGNAL: on it the worker writes its stacks (faulthandler)
# RTRAIN_RELIEVE_SIGNAL: memory pressure, free what you can at the next step boundary. SIGURG
# because its default action is to ignore it: a plain script, a DataLoader worker or a launcher
# in the group that does not handle it is left alone (SIGUSR1/2 and real-time signals would
# kill them), and the stop signals (SIGTERM, SIGUSR1) and the dump signal stay free.
RELIEVE_SIGNAL = "SIGURG"
# `Heartbeat.max_step_interval` leaves out the worker's first this-many step intervals (compile,
# autotune). The worker's own measure, fixed by the protocol; [hang] warmup_steps is separate:
# the step heartbeats the supervisor sees before it uses any interval.
MAX_INTERVAL_WARMUP_STEPS = 3



def socket_address(name: str) -> str | bytes:
    """`@name` is an abstract socket (no file, no 108-byte path limit); else a path."""
    return b"\0" + name[1:].encode() if name.startswith("@") else name


def control_request(what: str, token: str) -> bytes:
    """One request line for the control FIFO. It starts with a newline: another writer's
    unfinished line ends there instead of running into the request (the FIFO is read as one
    stream, and a write this short is never interleaved)."""
    return f"\n{what} {token}\n".encode()


def exit_record_name(rank: int) -> str:
    return f"exit-rank{rank}.json"


@dataclass
class Heartbeat:
    """One heartbeat datagram. `event` is `start`, `step`, `save_begin`, `save_end`, `save_skipped`
    (with `reason`: a checkpoint was not written, training goes on), `saved_at_failure` (with
    `reason`: the exception's type; the checkpoint of `step` was committed as an exception ended
    the process), `exiting` (the worker's atexit hook: the interpreter is ending),
    `hang_save_done` (the save at a hang that rtrain asked for through the control FIFO is over,
    `reason` says how many were saved), `control_refused` (requests on the control FIFO without
    the attempt's token were refused: `reason` says how many), `cadence` (with `cadence`: the
    save interval `every="auto"` chose, worker/saving/cadence.py), `backoff` (with `settings`),
    `snapshot` (with `snapshot`: the memory tier started, changed its interval or stopped),
    `persist` (with `persist`: a disk save under the memory tier; the snapshot of `step` is
    committed in memory and rtrain is to copy it, or a newer one, to the checkpoint dir),
    `compile_cache_loaded` / `compile_cache_ignored` (at restore, with `reason`: the checkpoint's
    compile cache was loaded, its size; or ignored, why: worker/compilecache/compile_cache.py),
    `relieved` (after a relieve request: `reason` says what was freed, `settings` what the
    worker now uses), `exception` (with `reason`: the type of the uncaught exception ending the
    process, sent as it begins its way out; `peer_lost` when it is a collective broken by a rank
    gone) or `stop`. The first `start` (the worker installed)
    carries `started`, the unix time the script began in this process; step heartbeats carry
    `step_s`, `wait_s` and `host` (the straggler rule's inputs); the one
    `Checkpointer.restore` sends carries `restore_s`, the seconds the checkpoint load took (the
    cost of a failure, records/recovery.py).

    A `persist` heartbeat is a request only: the Keep policy rtrain prunes with after the copy
    is the one the Checkpointer recorded in the snapshot's manifest (`info.keep`), never a
    heartbeat's field. Decoding keeps each field only when it has its type and lies within its
    bounds (`_FIELDS`); `pid` is replaced by the sender's pid as the kernel reports it."""

    pid: int
    rank: int
    time: float
    event: str = "step"
    step: int | None = None
    loss: float | None = None
    samples_per_s: float | None = None
    max_step_interval: float | None = None  # longest, after MAX_INTERVAL_WARMUP_STEPS
    next_save_step: int | None = None
    settings: dict[str, Any] | None = None  # settings the worker actually uses (after back-off)
    reason: str | None = None  # save_skipped: why not written; saved_at_failure: exception type
    cadence: dict[str, Any] | None = None  # cadence: `Cadence.fields()`
    world: int | None = None  # ranks in the group (torchrun's WORLD_SIZE), when under torchrun
    started: float | None = None  # first start: unix time the script began in this process
    restore_s: float | None = None  # restore's start: seconds the checkpoint load took
    # Step heartbeats: this rank's mean step interval since its previous step heartbeat, and
    # the mean time per step it waited for the other ranks, at the step-boundary collective and
    # inside DDP's all-reduce (the straggler rule, supervisor/straggler/decide.py).
    step_s: float | None = None
    wait_s: float | None = None
    host: str | None = None  # the node this rank runs on (its hostname)
    # `exception`: the exception is a collective broken by a rank that went away (gloo's closed
    # connection, NCCL's aborted communicator; worker/dist.py): the group broke elsewhere.
    peer_lost: bool | None = None
    # `snapshot` heartbeats (the memory tier, worker/memtier/memory_tier.py): {"every", "stall_s",
    # "write_s", "bytes"} when the tier starts or its interval changes; {"off": why} when it stops.
    snapshot: dict[str, Any] | None = None
    # RTRAIN_CONTROL_TOKEN, the attempt's secret: proves a sender is the attempt's own when
    # the kernel's word cannot (it exited before rtrain read its datagram: a forked writer).
    # Checked and removed on receipt (proc/heartbeat.py), never recorded.
    token: str | None = None
    v: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Heartbeat | None:
        """One heartbeat of this protocol version, each field typed and bounded; None for
        anything else (never raises). A field out of its type or bounds is dropped; a
        heartbeat without a valid pid, rank, time or event is dropped whole."""
        obj = _json_object(raw)
        if obj is None or obj.get("v") != PROTOCOL_VERSION:
            return None
        fields = {}
        for name, check in _FIELDS.items():
            value = check(obj.get(name))
            if value is not None:
                fields[name] = value
        if not all(name in fields for name in _REQUIRED):
            return None
        return cls(**fields)


@dataclass
class ExitRecord:
    """What the worker says about how it ended, written just before a failing exit."""

    kind: str  # a FailureKind value: oom_gpu, oom_host, nonfinite, data, crash, preempted
    reason: str
    pid: int
    rank: int = 0
    step: int | None = None
    exception: str | None = None
    traceback_tail: str | None = None
    settings: dict[str, Any] | None = None  # e.g. the smaller batch an in-process back-off found
    extra: dict[str, Any] = field(default_factory=dict)
    time: float | None = None  # wall clock when written: orders the ranks' failures
    v: int = PROTOCOL_VERSION

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)

    @classmethod
    def from_json(cls, text: str | bytes) -> ExitRecord | None:
        return _parse(cls, text)


# Heartbeat fields as rtrain accepts them: a datagram is the sender's word, and a field outside
# these bounds (a step of 10**30, a reason of a megabyte, a map nested a hundred deep) is never
# what the worker sends.
MAX_TEXT = 300  # reason, host: a sentence, a host name
MAX_MAP_BYTES = 4096  # settings, cadence, snapshot: a few knobs' values, as JSON
MAX_MAP_DEPTH = 4
MAX_RANK = 1 << 20
MAX_STEP = 1 << 62
MAX_SECONDS = 1e8  # an interval or a duration (three years)


def _int(lo: int, hi: int) -> Any:
    def check(v: Any) -> int | None:
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        return v if ok else None
    return check


def _num(lo: float, hi: float, *, finite: bool = True) -> Any:
    def check(v: Any) -> float | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        try:
            f = float(v)
        except OverflowError:
            return None
        if not math.isfinite(f):
            return None if finite else f  # a loss may be nan or inf: that is news
        return f if lo <= f <= hi else None
    return check


def _text(v: Any) -> str | None:
    return v[:MAX_TEXT] if isinstance(v, str) else None


def _event(v: Any) -> str | None:
    ok = isinstance(v, str) and 0 < len(v) <= 40 and v.replace("_", "").isalpha()
    return v if ok else None


def _depth(v: Any, left: int) -> bool:
    if isinstance(v, dict):
        return left > 0 and all(_depth(x, left - 1) for x in v.values())
    if isinstance(v, list):
        return left > 0 and all(_depth(x, left - 1) for x in v)
    return True


def _map(v: Any) -> dict[str, Any] | None:
    if not isinstance(v, dict) or not _depth(v, MAX_MAP_DEPTH):
        return None
    try:
        size = len(json.dumps(v))
    except (TypeError, ValueError):
        return None
    return v if size <= MAX_MAP_BYTES else None


_FIELDS: dict[str, Any] = {
    "pid": _int(1, 1 << 31), "rank": _int(0, MAX_RANK), "time": _num(0.0, 1e11),
    "event": _event, "step": _int(0, MAX_STEP),
    "loss": _num(-math.inf, math.inf, finite=False), "samples_per_s": _num(0.0, 1e15),
    "max_step_interval": _num(0.0, MAX_SECONDS), "next_save_step": _int(0, MAX_STEP),
    "settings": _map, "reason": _text, "cadence": _map, "world": _int(1, MAX_RANK),
    "started": _num(0.0, 1e11), "restore_s": _num(0.0, MAX_SECONDS),
    "step_s": _num(0.0, MAX_SECONDS), "wait_s": _num(0.0, MAX_SECONDS), "host": _text,
    "snapshot": _map, "token": lambda v: v if isinstance(v, str) and len(v) <= 64 else None,
    "peer_lost": lambda v: v if isinstance(v, bool) else None,
}
_REQUIRED = ("pid", "rank", "time", "event")


def _json_object(raw: str | bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except (ValueError, TypeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _parse(cls: type, raw: str | bytes) -> Any:
    """One message of this protocol version, or None for anything else (never raises):
    fields this version does not know are dropped, so a newer worker's extras are harmless."""
    try:
        obj = json.loads(raw)
        if obj.get("v") != PROTOCOL_VERSION:
            return None
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in obj.items() if k in known})
    except (ValueError, TypeError, AttributeError, RecursionError):
        return None

